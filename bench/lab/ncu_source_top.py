"""Where a kernel's warps stall: per SASS instruction, or summed per source line of this repository (with the chain of
inlined calls that led there). Reads the CSV of `ncu -i REP --page source --csv --print-source sass` (the report
taken with `--section SourceCounters --import-source yes`) and, for the per-line view, the same kernel's SASS with
line information: `nvdisasm -gi -c OBJ.cubin > OBJ.sass`, the cubin from `cuobjdump -xelf all` of the object built
with the same nvcc and flags (-lineinfo is on in CMakeLists.txt). ncu's own CUDA-source view attributes inlined code
to the kernel's entry line only, hence the join here; instructions are matched by their offset in the function,
and the opcodes are compared (a mismatch means another build).

Usage: python3 bench/lab/ncu_source_top.py PAGE.csv [--top 40]
       python3 bench/lab/ncu_source_top.py PAGE.csv --sass OBJ.sass --function SUBSTRING [--depth 4] [--top 40]
(docs/design/sparse_kernel.md, "Where the time goes", has the recipe and what it showed.)"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def read_page(path):
    """(header, rows) of ncu's SASS source page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(ln for ln in f if ln.strip() and not ln.startswith("==")))
    h = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)), None)
    if h is None:
        sys.exit(f"{path}: no 'Warp Stall Sampling (All Samples)' column; first rows: {rows[:2]}")
    return rows[h], [r for r in rows[h + 1:] if len(r) == len(rows[h])]


def opcode(text):
    t = text.strip().split()
    if t and t[0].startswith("@"):
        t = t[1:]
    return t[0].split(".")[0] if t else ""


def read_sass_lines(path, function):
    """offset -> (inline chain of (file, line), outermost first; instruction) for the function whose name holds
    `function`, from `nvdisasm -gi -c` output."""
    lines = open(path).read().split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith(".text.") and function in ln), None)
    if start is None:
        sys.exit(f"{path}: no function matching {function!r}")
    out, pending, chain = {}, [], []
    for ln in lines[start + 1:]:
        if ln.startswith(".text.") or ln.lstrip().startswith(".section"):
            break
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', ln)
        if m:
            pending.append((m.group(1), int(m.group(2))))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            if pending:  # printed innermost first
                chain, pending = list(reversed(pending)), []
            out[int(m.group(1), 16)] = (chain, m.group(2))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="the CSV of ncu's SASS source page")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sass", help="nvdisasm -gi -c output of the same build: sum the samples per source line")
    ap.add_argument("--function", default="", help="with --sass: a substring of the kernel's mangled name")
    ap.add_argument("--depth", type=int, default=4, help="with --sass: frames of src/ kept in the key")
    a = ap.parse_args(argv)
    head, body = read_page(a.csv)
    total_col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    src_col = next(i for i, c in enumerate(head) if c in ("Source", "# Source"))
    addr_col = head.index("Address") if "Address" in head else 0
    exec_col = head.index("Instructions Executed") if "Instructions Executed" in head else None
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[total_col]) for r in body) or 1.0

    def why(r):
        top = sorted(((number(r[i]), head[i][len("stall_"):]) for i in reasons), reverse=True)[:2]
        return ", ".join(f"{n} {v / total:.1%}" for v, n in top if v > 0)

    print(f"{a.csv}: {len(body)} instructions, {total:.0f} warp-stall samples")
    if a.sass:
        sass = read_sass_lines(a.sass, a.function)
        base = int(body[0][addr_col], 16)
        groups, execs, mismatched = defaultdict(float), defaultdict(float), 0
        for r in body:
            off = int(r[addr_col], 16) - base
            chain, text = sass.get(off, ([], ""))
            if opcode(text) != opcode(r[src_col]):
                mismatched += 1
            ours = [f"{f.rsplit('/', 1)[-1]}:{n}" for f, n in chain if "/src/" in f]
            key = " > ".join(ours[:a.depth]) or "(outside src/)"
            groups[key] += number(r[total_col])
            if exec_col is not None:
                execs[key] += number(r[exec_col])
        print(f"joined with {a.sass}: {mismatched} instructions whose opcodes differ (0: the same build)")
        for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"{v / total:6.2%}  executed {execs[k]:>12.0f}  {k}")
        return
    body.sort(key=lambda r: -number(r[total_col]))
    for r in body[:a.top]:
        print(f"{number(r[total_col]) / total:6.2%}  {r[addr_col]:>14}  {r[src_col].strip()[:90]:<90}  {why(r)}")
    groups = defaultdict(float)
    for r in body:
        groups[opcode(r[src_col]) or "?"] += number(r[total_col])
    print("by opcode:")
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{v / total:6.2%}  {k}")


if __name__ == "__main__":
    main()
