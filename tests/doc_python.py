"""Runs a page's Python blocks one after another in one namespace, as a reader would paste
them into one session. Reads one JSON request per line on stdin (``{"code", "name"}``) and
answers each on the file descriptor given as the first argument (``{"ok": bool}``); the
blocks' own output (and their child processes') goes to stderr."""

import json
import os
import sys
import traceback


def main() -> None:
    answer = os.fdopen(int(sys.argv[1]), "w")
    os.dup2(2, 1)  # children started by a block inherit stdout: keep it off the answers
    namespace = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            exec(compile(request["code"], request["name"], "exec"), namespace)
            ok = True
        except BaseException:  # noqa: BLE001 - any failure of a block is reported, then next
            traceback.print_exc()
            ok = False
        sys.stdout.flush()
        sys.stderr.flush()
        answer.write(json.dumps({"ok": ok}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
