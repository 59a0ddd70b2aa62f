"""Writes the compatibility matrix's results into docs/compatibility.md (called by
scripts/compat-matrix.sh).

``write_doc.py DOC CELL...``: the results arrive on stdin, one cell per line, tab-separated:
cell, versions, result, seconds, date. The table between the doc's ``matrix:begin`` and
``matrix:end`` markers is rewritten with one row per CELL, in that order: a cell run now
gets its new row, any other keeps the row it had (or "not run")."""

import sys

BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
HEADER = ["| Cell | Versions | Result | Seconds | Date |", "| --- | --- | --- | --- | --- |"]


def cells_of(table):
    rows = {}
    for line in table:
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 5 and parts[0] not in ("Cell", "---"):
            rows[parts[0].strip("`")] = parts
    return rows


def main():
    path, order = sys.argv[1], sys.argv[2:]
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        sys.exit(f"write_doc: {path} has no {BEGIN} ... {END} table")
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    rows = cells_of(table.splitlines())
    for line in sys.stdin:
        parts = line.rstrip("\n").split("\t")
        if len(parts) == 5:
            rows[parts[0]] = parts
    lines = list(HEADER)
    for cell in order:
        _, versions, result, seconds, date = rows.get(cell, [cell, "", "not run", "", ""])
        lines.append(f"| `{cell}` | {versions} | {result} | {seconds} | {date} |")
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


if __name__ == "__main__":
    main()
