#!/usr/bin/env python3
"""Attacks on a rendezvous root, measured (docs/SECURITY.md).

Starts rank 0 of a 2-rank job (NCCL_COMM_ID=127.0.0.1:PORT, a TUTTI_COMM_SECRET): it hosts the
rendezvous root and waits for rank 1. Then, against that port:
  flood:  20 connections, each a hello header claiming 64 MiB followed by 8 MiB of bytes;
  idle:   300 connections that never say anything, with rank 0 limited to 64 descriptors;
and reports rank 0's resident memory before and after, the CPU time it used during the attack
(a spinning listener burns a core), and whether rank 1 can still join and the job complete.

  tools/reliability/hello_flood.py BUILD_BIN
"""
import os
import socket
import struct
import subprocess
import sys
import time


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def scenario(binary, name, attack, nofile=None):
    port = free_port()
    env = dict(os.environ, TUTTI_SIZE="2", NCCL_COMM_ID=f"127.0.0.1:{port}", TUTTI_COMM_SECRET="flood-test",
               TUTTI_INIT_TIMEOUT="60")
    pre = (lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    r0 = subprocess.Popen([binary, "exchange", "65536"], env=dict(env, TUTTI_RANK="0"), preexec_fn=pre,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(200):  # wait for the root to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    time.sleep(0.3)
    rss0, cpu0 = rss_mib(r0.pid), cpu_s(r0.pid)
    socks = attack(port)
    time.sleep(2.0)
    rss1, cpu1 = rss_mib(r0.pid), cpu_s(r0.pid)
    r1 = subprocess.run([binary, "exchange", "65536"], env=dict(env, TUTTI_RANK="1"), capture_output=True, text=True,
                        timeout=120)
    for s in socks:
        s.close()
    out0 = r0.communicate(timeout=120)[0]
    ok = r0.returncode == 0 and r1.returncode == 0
    print(f"| {name} | {rss0:.0f} MiB | {rss1:.0f} MiB | {cpu1 - cpu0:.2f} s in 2 s | "
          f"{'job completed' if ok else 'job failed: ' + (out0 + r1.stdout + r1.stderr).strip().splitlines()[-1][:160]} |")


def flood(port):
    socks = []
    header = struct.pack("<IIQQ", 0x54545431, 1, 0, 64 << 20)  # magic "TTT1", kHello, tag, length
    junk = b"x" * (8 << 20)
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        try:
            s.send(header)
            s.send(junk)
        except OSError:
            pass
        socks.append(s)
    return socks


def idle(port):
    socks = []
    for _ in range(300):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        except OSError:
            pass
    return socks


def main():
    binary = os.path.join(sys.argv[1], "tutti-test-rank")
    print("| attack on rank 0's rendezvous root | rank 0 memory before | after | rank 0 CPU during the attack | then rank 1 joins |")
    print("|---|---|---|---|---|")
    scenario(binary, "20 hellos claiming 64 MiB, 8 MiB sent each", flood)
    scenario(binary, "300 idle connections, rank 0 limited to 64 descriptors", idle, nofile=64)


if __name__ == "__main__":
    main()
