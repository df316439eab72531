"""Checks a usage export with tools this project did not write (tests/tests/usage.rs runs it).

usage_check.py CSV JSONL OVERRIDES

- CSV: the FinOps Foundation's focus-validator (FOCUS 1.0), run as its own command, from the
  directory holding its package: 1.0.0 reads its currency codes at a path relative to the working
  directory (focus_validator/utils/currency_codes.csv). OVERRIDES names the rules it skips (see
  that file for why). It exits 0 even when validation fails, so its verdict is read from its
  output.
- JSONL: every line parsed by the CloudEvents SDK (cloudevents.http.from_json), which refuses a
  record without the required attributes.

Prints one JSON line: {"focus": VERDICT, "focusOutput": TEXT, "cloudevents": N, "types": [...]}.
"""

import json
import os
import subprocess
import sys

import cloudevents.http
import focus_validator


def main():
    csv_path, jsonl_path, overrides = sys.argv[1:4]
    package_parent = os.path.dirname(os.path.dirname(focus_validator.__file__))
    validator = os.path.join(os.path.dirname(sys.executable), "focus-validator")
    run = subprocess.run(
        [validator, "--data-file", os.path.abspath(csv_path), "--validate-version", "1.0",
         "--override-file", os.path.abspath(overrides)],
        cwd=package_parent, capture_output=True, text=True, check=False)
    output = run.stdout + run.stderr
    verdict = "succeeded" if "Validation succeeded." in output and "Errors encountered" not in output else "failed"

    parsed, types = 0, set()
    with open(jsonl_path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            try:
                event = cloudevents.http.from_json(line)
            except Exception as e:  # the SDK's own errors: say which line
                print(json.dumps({"focus": verdict, "focusOutput": output,
                                  "cloudeventsError": f"line {number}: {type(e).__name__}: {e}"}))
                return 1
            assert event["specversion"] == "1.0", event
            types.add(event["type"])
            parsed += 1
    print(json.dumps({"focus": verdict, "focusOutput": output, "cloudevents": parsed, "types": sorted(types)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
