"""Runs one docs page's code blocks in order: `python docs_runner.py BLOCKS.json`.

Started by tests/docs/test_code_blocks.py in the page's own directory. Python blocks run
in one namespace, compiled under the page's path and line numbers (a traceback points
into the markdown); shell blocks run with bash -e. The first block that fails ends the
run with exit status 1 and a line saying where.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path


def main(path: str) -> int:
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    namespace = {"__name__": "__main__"}
    for block in spec["blocks"]:
        where = f"{block['source']}:{block['line']}"
        print(f"--- {where} ({block['language']})", flush=True)
        if block["language"] == "python":
            # Padded so that the code's lines are the page's lines.
            code = compile("\n" * (block["line"] - 1) + block["code"], block["source"], "exec")
            try:
                exec(code, namespace)
            except BaseException:
                traceback.print_exc()
                print(f"docs block failed: {where}", flush=True)
                return 1
        else:
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block["code"]], check=False)
            if done.returncode != block["exits"]:
                print(
                    f"docs block failed: {where}: exit status {done.returncode}, not {block['exits']}",
                    flush=True,
                )
                return 1
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
