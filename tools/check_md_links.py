#!/usr/bin/env python3
"""check_md_links.py — every relative link in the repository's Markdown files must resolve: the
file or directory exists, and a #fragment names a heading of the target Markdown file (GitHub's
anchors: the heading's text lowercased, punctuation dropped, spaces to '-', repeats suffixed -1,
-2, ...) or an explicit <a name/id>. Absolute URLs are not fetched. Prints each broken link as
FILE:LINE: and exits 1 if there is any.

usage: python3 tools/check_md_links.py [FILE.md ...]   (default: every *.md git tracks)
"""
import os
import re
import subprocess
import sys
import unicodedata

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                    r"(?:\s+[\"'(][^)]*)?\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def markdown_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    fence = None
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark
                continue
            if mark[0] == fence[0] and len(mark) >= len(fence):
                fence = None
                continue
        if fence is None:
            yield n, line


def heading_text(raw):
    """What GitHub renders of a heading's Markdown: code spans' text, links' text, no emphasis or HTML."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    return re.sub(r"(?<!\w)(_{1,3})(\S(?:.*?\S)?)\1(?!\w)", r"\2", text)  # not intraword _


def slug(text):
    """GitHub's anchor for a heading's rendered text."""
    keep = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return keep.replace(" ", "-")


def anchors(path, cache={}):
    """The fragments a Markdown file answers to."""
    if path not in cache:
        seen, found = {}, set()
        for _, line in markdown_lines(path):
            found.update(HTML_ANCHOR.findall(line))
            m = HEADING.match(line)
            if m:
                base = slug(heading_text(m.group(2)))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def links(path):
    """(line number, target) of every inline link, image and reference definition, code spans skipped."""
    for n, line in markdown_lines(path):
        bare = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        targets = [m.group(1) for m in INLINE.finditer(bare)]
        m = REFDEF.match(bare)
        if m:
            targets.append(m.group(1))
        for t in targets:
            yield n, t[1:-1] if t.startswith("<") else t


def check(path, root):
    """Messages for the broken links of one file."""
    bad = []
    for n, target in links(path):
        if not target or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # an absolute URL (http:, mailto:, ...): not checked here
        file_part, _, frag = target.partition("#")
        file_part = re.sub(r"%20", " ", file_part.split("?")[0])
        if file_part.startswith("/"):
            dest = os.path.join(root, file_part.lstrip("/"))
        else:
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest):
            bad.append(f"{path}:{n}: {target}: no such file {os.path.relpath(dest, root)}")
        elif frag and dest.endswith(".md") and os.path.isfile(dest) and frag not in anchors(dest):
            bad.append(f"{path}:{n}: {target}: no heading #{frag} in {os.path.relpath(dest, root)}")
        elif frag and not dest.endswith(".md") and not re.fullmatch(r"L\d+(-L\d+)?", frag):
            bad.append(f"{path}:{n}: {target}: #{frag} in a file that is not Markdown")
    return bad


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sys.argv[1:]
    if not files:
        out = subprocess.run(["git", "-C", root, "ls-files", "*.md"], capture_output=True, text=True, check=True)
        files = [os.path.join(root, f) for f in out.stdout.split()]
    bad = [msg for f in files for msg in check(os.path.relpath(f), root)]
    print("\n".join(bad) if bad else f"{len(files)} Markdown files: every relative link resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
