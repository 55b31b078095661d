"""results_md.py — the one writer of bench/RESULTS.md's sections, shared by every bench.

A bench run with --out FILE writes its own section of FILE: a heading, a provenance block
(date in UTC, git commit, machine, the exact command line, the peers measured beside fmha)
and its tables, between `<!-- fmha-bench:NAME begin -->` and `<!-- fmha-bench:NAME end -->`.
A section of that name already in FILE is replaced where it stands; the rest of FILE is left
as it is, so that several benches (and several machines, with --section) write into one file.

    results_md.add_arguments(ap, {"cpu": "CPU forward"})   # --out, --section, --heading, --note
    ...
    results_md.write(opt, [("Machine", results_md.cpu_machine()), ("Peers", "...")], body)

Standard library only: the CPU bench runs where torch is not installed.
"""
import datetime
import os
import re
import shlex
import subprocess
import sys

MARK = "<!-- fmha-bench:{} {} -->"
NAME = re.compile(r"[a-z0-9][a-z0-9-]*\Z")


def add_arguments(ap, headings):
    """--out FILE.md, --section NAME, --heading TEXT, --note TEXT. headings maps the bench's section
    names to their headings; the first is the default section unless the bench picks one (opt.section
    is None until then: see section())."""
    g = ap.add_argument_group("results file (bench/results_md.py)")
    g.add_argument("--out", metavar="FILE.md",
                   help="write (or replace) this run's section of FILE.md, e.g. bench/RESULTS.md")
    g.add_argument("--section", help="the section's marker name (default: " + ", ".join(headings) +
                   " by what the run measures); another name keeps both, e.g. one per machine")
    g.add_argument("--heading", help="the section's heading (default: the section's own)")
    g.add_argument("--note", action="append", default=[],
                   help="a line added to the provenance (repeatable), e.g. what else loaded the machine")
    ap.set_defaults(results_headings=dict(headings))


def section(opt, default=None):
    """The section this run writes: --section, else `default`, else the bench's first."""
    return opt.section or default or next(iter(opt.results_headings))


def _run(cmd):
    """stdout of cmd, stripped, or None where it cannot run or fails."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit(exclude=()):
    """`git rev-parse --short HEAD`, plus -dirty where tracked files differ from it. The files in
    `exclude` (the results file being written) do not count: a second bench writing into the
    same RESULTS.md would otherwise call the tree dirty because of the first."""
    head = _run(["git", "rev-parse", "--short", "HEAD"])
    if head is None:
        return "unknown (not a git checkout)"
    top = _run(["git", "rev-parse", "--show-toplevel"]) or "."
    rel = [os.path.relpath(os.path.abspath(p), top) for p in exclude]
    spec = [f":(exclude){r}" for r in rel if not r.startswith("..")]  # files outside the tree: no pathspec
    status = _run(["git", "-C", top, "status", "--porcelain", "--untracked-files=no", "--", "."] + spec)
    if status is None:
        return head + " (git status failed: clean or dirty unknown)"
    return head + ("-dirty" if status else "")


def command_line():
    """The command as typed, with python3 for the interpreter."""
    return "python3 " + shlex.join(sys.argv)


def cpu_machine():
    """CPU model, vendor/family/model, logical CPUs, the vector ISA, hypervisor, memory (Linux /proc)."""
    info, mem = {}, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                info.setdefault(key.strip(), val.strip())
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = ("AVX-512 with AVX512_BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2+FMA" if "avx2" in flags else "no AVX2")
    parts = [f"{info.get('model name', 'unknown CPU')} ({info.get('vendor_id', '?')}, family "
             f"{info.get('cpu family', '?')} model {info.get('model', '?')})",
             f"{os.cpu_count()} logical CPUs", isa]
    if "hypervisor" in flags:
        parts.append("virtualised")
    if mem:
        parts.append(f"{mem:.0f} GiB")
    return ", ".join(parts)


def cmake_build(build_dir):
    """Compiler and build type of a CMake build directory, from its cache."""
    cache = {}
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                m = re.match(r"(CMAKE_C_COMPILER|CMAKE_BUILD_TYPE|FMHA_CUDA):\w+=(.*)", line)
                if m:
                    cache[m.group(1)] = m.group(2).strip()
    except OSError:
        return f"{build_dir} (no CMakeCache.txt)"
    cc = cache.get("CMAKE_C_COMPILER", "cc")
    version = (_run([cc, "--version"]) or cc).splitlines()[0]
    return (f"`{build_dir}`: {version}, CMAKE_BUILD_TYPE={cache.get('CMAKE_BUILD_TYPE') or '(none)'}"
            + (f", FMHA_CUDA={cache['FMHA_CUDA']}" if "FMHA_CUDA" in cache else ""))


def gpu_machine(torch):
    """GPU name and SM count, driver and power limit (nvidia-smi), torch, CUDA and cuDNN versions."""
    props = torch.cuda.get_device_properties(0)
    smi = _run(["nvidia-smi", "-i", "0", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                "--format=csv,noheader"])
    board = ""
    if smi:
        driver, limit, mhz = (s.strip() for s in smi.split(","))
        board = f", driver {driver}, power limit {limit}, SM clock up to {mhz}"
    return (f"{props.name} ({props.multi_processor_count} SMs{board}), torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), cuDNN {torch.backends.cudnn.version()}")


def table(header, rows, align):
    """A Markdown table; align holds one 'l' or 'r' per column."""
    if len(align) != len(header) or any(len(r) != len(header) for r in rows):
        raise ValueError("table: every row needs one cell per header column")
    sep = ["---" if a == "l" else "---:" for a in align]
    return "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in [header, sep] + list(rows))


def render(name, heading, fields, body):
    """The section's text, markers included: heading, one bullet per (key, value), the body."""
    if not NAME.match(name):
        raise SystemExit(f"--section {name!r}: lowercase letters, digits and '-' only")
    lines = [MARK.format(name, "begin"), f"## {heading}", ""]
    lines += [f"- **{key}:** {val}" for key, val in fields]
    lines += ["", body.strip("\n"), "", MARK.format(name, "end")]
    return "\n".join(lines)


def write_section(path, name, text):
    """Replace section `name` of the Markdown file at path by text (render's), or append it; atomic."""
    begin, end = MARK.format(name, "begin"), MARK.format(name, "end")
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    i = old.find(begin)
    if i >= 0:
        j = old.find(end, i)
        if j < 0:
            raise SystemExit(f"{path}: {begin} has no {end}")
        if old.find(begin, j) >= 0:
            raise SystemExit(f"{path}: section {name} appears twice")
        new = old[:i] + text + old[j + len(end):]
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + text + "\n"
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def write(opt, fields, body, name=None):
    """Write this run's section (name, or section(opt)) to opt.out; nothing without --out. The
    provenance is date, commit, `fields` (machine, peers, ... in the order given), the command
    line, then each --note."""
    if not opt.out:
        return
    name = name or section(opt)
    first = next(iter(opt.results_headings.values()))
    heading = opt.heading or opt.results_headings.get(name) or f"{first} ({name})"
    prov = [("Date", utc_now()), ("Commit", f"`{git_commit(exclude=[opt.out])}`")] + list(fields)
    prov.append(("Command", f"`{command_line()}`"))
    prov += [("Note", n) for n in opt.note]
    write_section(opt.out, name, render(name, heading, prov, body))
    print(f"wrote section {name} of {opt.out}", file=sys.stderr)
