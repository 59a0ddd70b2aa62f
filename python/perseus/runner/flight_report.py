"""The flight recorder's diagnosis from its files, after the fact:

    python -m perseus.runner.flight_report DIR [DIR ...]

``DIR``: a directory of a job's ``rank.<R>.json`` files (perseus.common.flight_recorder),
or one per host where the ranks of several hosts wrote their own. Prints which ranks
left records and the diagnosis perseusrun gives (ranks that left none count as gone).
"""

import argparse
import sys

from perseus.common import flight_recorder


def report(dirs):
    """The lines of the report on the records in ``dirs``; empty when there are none."""
    records = {}
    for d in dirs:
        records.update(flight_recorder.read(d))
    if not records:
        return []
    sizes = [r["size"] for r in records.values() if r.get("size")]
    gone = {r: "wrote no record" for r in range(max(sizes, default=0)) if r not in records}
    newest = max(r.get("time", 0) for r in records.values())
    return ([f"records of ranks {', '.join(map(str, sorted(records)))}"
             + (f" (none of {', '.join(map(str, sorted(gone)))})" if gone else "")]
            + flight_recorder.diagnose(records, now=newest, gone=gone))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", metavar="DIR")
    a = p.parse_args(argv)
    lines = report(a.dirs)
    if not lines:
        print(f"no rank.<R>.json in {' '.join(a.dirs)}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
