#!/usr/bin/env python3
"""Fault-injection trials: runs tutti-fault-rank under each TUTTI_FAULT kind many times, as threads
and as processes, over shared memory and TCP, and prints per kind the outcomes (every rank ended
with an error / every rank exact / anything else) and the time from the start of the faulty call
to the error on each surviving rank (median and maximum over all ranks of all trials).

  tools/reliability/fault_trials.py BUILD_BIN [--trials 10] [--timeout 2]

A trial whose ranks do not all end within 60 s counts as a hang. Results go to stdout as a
Markdown table (docs/RELIABILITY.md keeps the last one).
"""
import argparse
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"^rank (\d+): (ok|error in call \d+, ([0-9.]+) s after|WRONG)", re.M)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def parse(text):
    out = {}
    for m in LINE.finditer(text):
        rank = int(m.group(1))
        if m.group(2) == "ok":
            out[rank] = ("ok", None)
        elif m.group(2) == "WRONG":
            out[rank] = ("wrong", None)
        else:
            out[rank] = ("error", float(m.group(3)))
    return out


def run_threads(binary, fault, transport, count, timeout):
    env = dict(os.environ, TUTTI_FAULT=fault, TUTTI_TIMEOUT=str(timeout), TUTTI_TRANSPORT=transport)
    try:
        p = subprocess.run([binary, "--threads", "3", "--calls", "5", "--fault-call", "3", "--count", str(count)],
                           env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None, set()
    return parse(p.stdout), set()


def run_processes(binary, fault, transport, count, timeout):
    comm_id = f"127.0.0.1:{free_port()}"
    secret = secrets.token_hex(16)
    procs = []
    for r in range(3):
        env = dict(os.environ, TUTTI_FAULT=fault, TUTTI_TIMEOUT=str(timeout), TUTTI_TRANSPORT=transport,
                   TUTTI_RANK=str(r), TUTTI_SIZE="3", TUTTI_COMM_ID=comm_id, TUTTI_COMM_SECRET=secret)
        procs.append(subprocess.Popen([binary, "--calls", "5", "--fault-call", "3", "--count", str(count)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    victims = set()
    deadline = time.time() + 60
    outputs = [""] * 3
    # Wait for every rank that ends; one that stopped itself is killed once the others are done.
    pending = set(range(3))
    while pending and time.time() < deadline:
        for r in list(pending):
            pid, status = os.waitpid(procs[r].pid, os.WNOHANG | os.WUNTRACED)
            if pid == 0:
                continue
            if os.WIFSTOPPED(status):
                victims.add(r)
            else:
                if os.WIFSIGNALED(status):
                    victims.add(r)
                procs[r].returncode = 0
            pending.discard(r)
        time.sleep(0.005)
    hung = bool(pending)
    for r in range(3):
        if r in victims or r in pending:
            try:
                procs[r].send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        outputs[r] = procs[r].stdout.read()
        try:
            os.waitpid(procs[r].pid, 0)
        except ChildProcessError:
            pass
    if hung:
        return None, victims
    reports = {}
    for text in outputs:
        reports.update(parse(text))
    return reports, victims


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=2)
    a = ap.parse_args()
    binary = os.path.join(a.bin, "tutti-fault-rank")
    kinds = [
        ("kill", "kill:rank=1:call=3", ["processes"]),
        ("kill mid-call (step 2)", "kill:rank=1:call=3:step=2", ["processes"]),
        ("stop", "stop:rank=1:call=3", ["processes"]),
        ("close", "close:rank=1:call=3", ["threads", "processes"]),
        ("drop", "drop:rank=1:call=3", ["threads", "processes"]),
        ("corrupt", "corrupt:rank=1:call=3", ["threads", "processes"]),
        ("corrupt mid-call (step 2)", "corrupt:rank=1:call=3:step=2", ["threads", "processes"]),
        ("delay 0.5 s (< timeout)", "delay:rank=1:call=3:seconds=0.5", ["threads", "processes"]),
        (f"delay {a.timeout + 2:g} s (> timeout)", f"delay:rank=1:call=3:seconds={a.timeout + 2:g}", ["threads"]),
    ]
    paths = [("shm", 256), ("shm", 1 << 18), ("tcp", 256), ("tcp", 1 << 18)]
    print(f"| fault | ranks as | trials | every rank errored | every rank exact | wrong data | hang or other | "
          f"time to error, median | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, fault, modes in kinds:
        for mode in modes:
            counts = {"error": 0, "ok": 0, "wrong": 0, "other": 0}
            times = []
            trials = 0
            for t in range(a.trials):
                transport, count = paths[t % len(paths)]
                if "step=2" in fault and count < 1 << 18:
                    count = 1 << 18  # one-shot calls have no step 2
                run = run_threads if mode == "threads" else run_processes
                reports, victims = run(binary, fault, transport, count, a.timeout)
                trials += 1
                if reports is None:
                    counts["other"] += 1
                    continue
                survivors = [r for r in range(3) if r not in victims]
                states = [reports.get(r, ("missing", None))[0] for r in survivors]
                if any(s == "wrong" for s in states):
                    counts["wrong"] += 1
                elif all(s == "error" for s in states):
                    counts["error"] += 1
                    times += [reports[r][1] for r in survivors]
                elif all(s == "ok" for s in states):
                    counts["ok"] += 1
                else:
                    counts["other"] += 1
            med = f"{statistics.median(times) * 1e3:.1f} ms" if times else "-"
            mx = f"{max(times) * 1e3:.1f} ms" if times else "-"
            print(f"| {label} | {mode} | {trials} | {counts['error']} | {counts['ok']} | {counts['wrong']} | "
                  f"{counts['other']} | {med} | {mx} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
