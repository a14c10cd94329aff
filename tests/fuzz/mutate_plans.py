#!/usr/bin/env python3
"""Mutated plan files against `tutti-compile --import FILE --verify`.

Each seed (the public MSCCL XMLs and tutti JSON plans written by tutti-compile) is damaged at random:
elements or fields removed, numbers made huge, negative or out of range, thousands of unknown
elements or attributes added, text cut short. Every run must end in time with exit 0 (a plan that
still verifies) or 1 with an error message; a crash (a signal, an uncaught exception's abort),
a hang past the limit, or a peak memory over the limit is counted and the file kept.

  tests/fuzz/mutate_plans.py BUILD_BIN SEED_DIR... [--trials 400] [--seed 1] [--keep DIR]
Prints the outcome counts and exits 1 when anything was not refused cleanly.
"""
import argparse, json, os, random, re, resource, shutil, subprocess, sys, tempfile, time

HUGE = ["99999999999", "-1", "-2147483649", "4294967296", "1e9", "100000000", "2147483647", "", "x"]


def mutate_xml(text, rng):
    kind = rng.randrange(6)
    if kind == 0:  # a number made huge, negative or odd
        nums = list(re.finditer(r'="(-?\d+)"', text))
        if nums:
            m = rng.choice(nums)
            return text[:m.start(1)] + rng.choice(HUGE) + text[m.end(1):]
    if kind == 1:  # an element removed
        elems = list(re.finditer(r"<(step|tb|gpu)[^>]*?/>", text)) or list(re.finditer(r"<step[^>]*>", text))
        if elems:
            m = rng.choice(elems)
            return text[:m.start()] + text[m.end():]
    if kind == 2:  # thousands of unknown elements
        at = text.find("<gpu")
        junk = "".join(f'<junk{i} a="{i}"/>\n' for i in range(rng.choice([100, 2000, 8000])))
        return text[:at] + junk + text[at:] if at >= 0 else text + junk
    if kind == 3:  # thousands of unknown attributes
        at = text.find("<tb ")
        if at >= 0:
            attrs = " ".join(f'x{i}="{i}"' for i in range(rng.choice([100, 3000])))
            return text[:at + 4] + attrs + " " + text[at + 4:]
    if kind == 4:  # cut short
        return text[: rng.randrange(max(1, len(text)))]
    # an attribute removed
    attrs = list(re.finditer(r' \w+="[^"]*"', text))
    if attrs:
        m = rng.choice(attrs)
        return text[:m.start()] + text[m.end():]
    return text


def mutate_json(text, rng):
    try:
        doc = json.loads(text)
    except ValueError:
        return text[: rng.randrange(max(1, len(text)))]
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + [k])
        elif isinstance(x, list):
            for i, v in enumerate(x[:50]):
                walk(v, path + [i])

    walk(doc, [])
    path = rng.choice(paths[1:] or [[]])
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1] if path else None
    kind = rng.randrange(6)
    if key is None:
        return "[]"
    if kind == 0:
        parent[key] = rng.choice([10**12, -1, 2**31, 2**63 - 1, 1e300, 0])
    elif kind == 1:
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif kind == 2:
        parent[key] = rng.choice(["text", None, {}, [], True, [[]], {"a": 1}])
    elif kind == 3 and isinstance(parent, dict):
        for i in range(rng.choice([100, 3000])):
            parent[f"unknown{i}"] = i
    elif kind == 4 and isinstance(parent, list):
        parent.extend([parent[key]] * rng.choice([10, 1000]))
    else:
        out = json.dumps(doc)
        return out[: rng.randrange(max(1, len(out)))]
    return json.dumps(doc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("seeds", nargs="+")
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10)
    ap.add_argument("--memory-mb", type=int, default=2048)
    ap.add_argument("--keep", default="")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    seeds = []
    for d in a.seeds:
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else [os.path.basename(d)]:
            p = os.path.join(d, f) if os.path.isdir(d) else d
            if p.endswith((".xml", ".json")):
                seeds.append(p)
    tmp = tempfile.mkdtemp()
    counts = {"verified": 0, "refused": 0, "crash": 0, "timeout": 0, "no message": 0}
    slowest = 0.0
    bad = []

    def limit():
        lim = a.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))

    for t in range(a.trials):
        seed = rng.choice(seeds)
        text = open(seed).read()
        for _ in range(rng.randrange(1, 3)):
            text = mutate_xml(text, rng) if seed.endswith(".xml") else mutate_json(text, rng)
        path = os.path.join(tmp, f"t{t}" + os.path.splitext(seed)[1])
        open(path, "w").write(text)
        t0 = time.time()
        try:
            r = subprocess.run([os.path.join(a.bin, "tutti-compile"), "--import", path, "--verify"],
                               capture_output=True, text=True, timeout=a.timeout, preexec_fn=limit)
            outcome = "verified" if r.returncode == 0 else "refused" if r.returncode == 1 else "crash"
            if outcome == "refused" and "tutti-compile:" not in r.stderr and "error" not in r.stderr.lower():
                outcome = "no message"
        except subprocess.TimeoutExpired:
            outcome = "timeout"
        slowest = max(slowest, time.time() - t0)
        counts[outcome] += 1
        if outcome in ("crash", "timeout", "no message"):
            bad.append((path, outcome, (r.stderr if outcome != "timeout" else "")[-300:]))
            if a.keep:
                os.makedirs(a.keep, exist_ok=True)
                shutil.copy(path, a.keep)
    print(f"{a.trials} mutated plans from {len(seeds)} seeds: " + ", ".join(f"{v} {k}" for k, v in counts.items()) +
          f"; slowest {slowest:.2f} s")
    for p, o, err in bad[:10]:
        print(f"  {o}: {os.path.basename(p)}: {err.strip()}")
    shutil.rmtree(tmp)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
