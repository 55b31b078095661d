#!/usr/bin/env python3
"""Checks that libfmha.so exports include/fmha.h's functions and nothing else,
and that it does not link NCCL (comm_nccl.c opens the process's NCCL at run
time, so that loading libfmha never puts a second NCCL before a framework's).

usage: check_exports.py HEADER LIBRARY [NM]   (NM: the nm to run, default nm)

Every function the header declares must carry FMHA_API (the one visible
declaration), and the library's dynamic symbol table (nm -D --defined-only)
must hold exactly those functions: a missing one breaks programs, an extra one
is an internal function a program could come to depend on.
"""
import re
import subprocess
import sys


def declared_functions(header):
    """{name: marked} for every function declaration of the header."""
    with open(header, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*(\\\n[^\n]*)*", " ", text, flags=re.M)
    functions = {}
    # Statements end at ; { or }; in a function declaration the statement's
    # first parenthesis follows the function's name (a struct field or an enum
    # value has none, a function pointer's name sits inside one).
    for statement in re.split(r"[;{}]", text):
        paren = statement.find("(")
        if paren < 0:
            continue
        m = re.search(r"\b(fmha_\w+)\s*$", statement[:paren])
        if m:
            functions[m.group(1)] = re.search(r"\bFMHA_API\b", statement[:paren]) is not None
    return functions


def exported_symbols(library, nm):
    out = subprocess.run([nm, "-D", "--defined-only", library], check=True, capture_output=True,
                         text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def needed_libraries(library):
    """The DT_NEEDED entries of the library (empty where readelf is missing)."""
    try:
        out = subprocess.run(["readelf", "-d", library], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    header, library = sys.argv[1], sys.argv[2]
    nm = sys.argv[3] if len(sys.argv) == 4 else "nm"
    functions = declared_functions(header)
    exported = exported_symbols(library, nm)
    unmarked = sorted(n for n, marked in functions.items() if not marked)
    missing = sorted(set(functions) - exported)
    extra = sorted(exported - set(functions))
    for n in unmarked:
        print("check_exports: %s is declared without FMHA_API" % n)
    for n in missing:
        print("check_exports: %s is declared in %s but not exported" % (n, header))
    for n in extra:
        print("check_exports: %s is exported but not declared in %s" % (n, header))
    nccl = [n for n in needed_libraries(library) if n.startswith("libnccl")]
    for n in nccl:
        print("check_exports: %s links %s (NCCL must be opened at run time)" % (library, n))
    if unmarked or missing or extra or nccl:
        sys.exit(1)
    print("check_exports: %s exports the %d functions of %s, nothing else"
          % (library, len(functions), header))


if __name__ == "__main__":
    main()
