#!/usr/bin/env python3
"""check_layers.py — fails when the files of src/ depend on each other in a circle.

A file depends on another when it #includes it, or when it calls, or takes the
address of, an fmha_* function or object that the other defines (headers own
their static inline functions; what a header only declares is no use of it). Modules are nodes (a header and the source file
of the same name are one module: x.h with x.c, x.cuh with x.cu); the script
prints every strongly connected set of two or more with the edges that close
it, and exits 1 if there is one.

    python3 tools/check_layers.py [SRC_DIR]      # default: src
    python3 tools/check_layers.py --graph        # also print every edge
"""
import os
import re
import sys

EXTS = (".c", ".h", ".cu", ".cuh", ".inc", ".def")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# A definition: an fmha_ name followed by a parameter list and a body, or by
# `=` at file scope (tables such as fmha_kernels or a backend's operations).
DEF_FN = re.compile(r"\b(fmha_\w+)\s*\([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*\)\s*(?:__attribute__\s*\(\(.*?\)\)\s*)?\{", re.S)
DEF_OBJ = re.compile(r"^[A-Za-z_][\w\s\*]*\b(fmha_\w+)\s*(?:\[[^\]]*\])?\s*=", re.M)
USE = re.compile(r"\b(fmha_\w+)\b")


EXTERN_C_OPEN = re.compile(r'extern\s+""\s*\{')
EXTERN_C_CLOSE = re.compile(r"#\s*ifdef\s+__cplusplus\s*\n\s*\}\s*\n\s*#\s*endif")


def strip(text):
    text = COMMENT.sub(" ", text)
    # Keep include lines' strings; blank the others.
    text = "\n".join(line if line.lstrip().startswith("#") else STRING.sub('""', line)
                     for line in text.split("\n"))
    # extern "C" { ... } is file scope.
    return EXTERN_C_CLOSE.sub(" ", EXTERN_C_OPEN.sub(" ", text))


def module(path):
    """A header and the source file of the same name are one module: x.h + x.c, x.cuh + x.cu."""
    stem, ext = os.path.splitext(path)
    return stem if ext in (".c", ".h", ".cu", ".cuh") else path


def split_scopes(text):
    """(file scope, bodies): the text with every brace-enclosed body blanked, and
    the text with everything but those bodies blanked."""
    top, body, depth = [], [], 0
    for ch in text:
        if ch == "{":
            depth += 1
            top.append("{" if depth == 1 else " ")
            body.append(" ")
        elif ch == "}":
            depth -= 1
            top.append(" ")
            body.append(" ")
        else:
            top.append(ch if depth == 0 or ch == "\n" else " ")
            body.append(ch if depth > 0 or ch == "\n" else " ")
    return "".join(top), "".join(body)


def main(argv):
    graph = "--graph" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    root = os.path.normpath(root)
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(EXTS):
                p = os.path.join(d, n)
                with open(p, encoding="utf-8", errors="replace") as f:
                    files[os.path.relpath(p, root)] = strip(f.read())

    owner, uses = {}, {}
    for name, text in files.items():
        top, body = split_scopes(text)
        # A header's file scope only declares; what its inline bodies call is a use.
        uses[name] = body if name.endswith((".h", ".cuh")) else text
        for m in DEF_FN.finditer(text):
            # Only definitions at file scope: the name's position is outside any body.
            if top[m.start(1):m.end(1)] == m.group(1):
                owner.setdefault(m.group(1), name)
        for m in DEF_OBJ.finditer(top):
            if not top[m.start():m.end()].lstrip().startswith("extern"):
                owner.setdefault(m.group(1), name)

    edges = {}
    for name, text in files.items():
        here = os.path.dirname(name)
        src = module(name)
        for inc in INCLUDE.findall(text):
            target = os.path.normpath(os.path.join(here, inc))
            if target in files and module(target) != src:
                edges.setdefault(src, {}).setdefault(module(target), f"{name} includes {target}")
        for sym in set(USE.findall(uses[name])):
            target = owner.get(sym)
            if target and module(target) != src:
                edges.setdefault(src, {}).setdefault(module(target), f"{name} uses {sym}, from {target}")
    nodes = sorted({module(n) for n in files})

    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)

    if graph:
        for v in sorted(edges):
            for w, why in sorted(edges[v].items()):
                print(f"{v} -> {w}: {why}")
    for comp in sccs:
        print(f"circle among {len(comp)} modules of {root}:")
        members = set(comp)
        for v in comp:
            for w, why in sorted(edges.get(v, {}).items()):
                if w in members:
                    print(f"  {v} -> {w}: {why}")
    if sccs:
        return 1
    print(f"check_layers: {len(files)} files, {len(nodes)} modules of {root}, "
          f"{sum(len(e) for e in edges.values())} dependencies, no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
