#!/usr/bin/env python3
"""Runs a test command and checks both its exit status and its output (CTest's
PASS_REGULAR_EXPRESSION alone ignores the status, so a tool that printed the right line and then
crashed would pass).

  expect_output.py STATUS REGEX COMMAND [ARGS...]
STATUS: 0 (the command must succeed) or fail (it must exit with a non-zero status, not a signal).
REGEX: a Python regular expression searched in stdout + stderr ('.' matches newlines too).
"""
import re
import subprocess
import sys

status, pattern, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
out = r.stdout.decode(errors="replace")
sys.stdout.write(out)
ok_status = r.returncode == 0 if status == "0" else r.returncode > 0
if not ok_status:
    print(f"\nexpect_output: exit status {r.returncode}, expected {'0' if status == '0' else 'a failure (> 0)'}")
    sys.exit(1)
if not re.search(pattern, out, re.S):
    print(f"\nexpect_output: the output does not match {pattern!r}")
    sys.exit(1)
