#!/usr/bin/env python3
"""bench/lua_diff.py: the work tree's lua/ library against the one of a git
revision, decision by decision, on random inputs.

    bench/lua_diff.py [--rev REV] [--cases N] [--seed S] [--commands] [--alg A]

Starts a private redis-server, loads both libraries exactly as RedisStore
loads them (what `cargo run --example lua_library` prints: lua/ assembled by
build.rs; a revision is built from `git archive` in a target folder of its
own under target/lua-bench/, which bench/lua.sh shares), and
runs random cases through both, each on its own copy of the same keys: a
random limit of each algorithm (parameters as `derive` in src/quota.rs
allows), the keys first given identical random history (decisions of other
limits on them: a rolling deploy; values of the right tag and length with
garbage fields; values of another type), then steps of random time (forward,
and sometimes back), cost, max_wait, dry run and expiry slack, now and then a
refund or a take, or the limit decided next to a second one. After every step
the two replies must say the same (each read in its library's wire: a
library with `OPT_NOW` in it, written from src/algorithm/wire.rs, sends a
limit's three parameters and replies a typed status per limit; one before
sends four parameters, the fourth 0, and three doubles per limit with -1 for
"never" and for a block), and so must the keys: their
values (a sliding log's members and scores) and their expiries to the
millisecond, as Redis was told them (every decision sets keys an hour of
expiry slack, so that none expires in real time during a case): every write command the scripts issue is
read from MONITOR, and with --commands those must be the same commands too
(for changes that should not change what a decision writes). Then the
production path (no options, Redis' clock), which has no twin to agree
with: its replies carry Redis' clock and a sliding log's scores are the
times its members record.

Exit status 0 when every step agreed. Needs redis-server, python3 and git.
"""
import argparse
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT = 2 ** 53
HOUR = 3_600_000_000  # us
KEY_PARTS = {1: ["log", "meta"], 2: ["tb"], 3: ["gcra"], 4: ["fw"], 5: ["sw"]}


class Conn:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def send(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            if isinstance(a, str):
                a = a.encode()
            elif isinstance(a, (int, float)):
                a = str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.s.sendall(b"".join(out))

    def line(self):
        while b"\r\n" not in self.buf:
            self.buf += self.s.recv(65536)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def read(self):
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.s.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ValueError(line)

    def __call__(self, *args):
        self.send(*args)
        return self.read()


def library(rev):
    """The library of `rev` ("work": the work tree) as RedisStore loads it
    (`cargo run --example lua_library`): its function's name, its text, and
    its wire (2: op codes and typed statuses written from
    src/algorithm/wire.rs; 1: before)."""
    tree, target = ROOT, None
    if rev != "work":
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
        tree = tempfile.mkdtemp(prefix="lua-diff-")
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        # a target folder per tree: one shared with the work tree could give
        # every tree the work tree's library
        target = os.path.join(ROOT, "target", "lua-bench", safe)
    env = dict(os.environ)
    if target:
        env["CARGO_TARGET_DIR"] = target
    lib = subprocess.check_output(["cargo", "run", "-q", "--example", "lua_library"], cwd=tree, env=env)
    first = lib.split(b"\n", 1)[0]
    assert first.startswith(b"#!lua name="), first
    name = first[len(b"#!lua name="):].decode()
    return name, lib, 2 if b"OPT_NOW" in lib else 1


def rand_limit(rng, alg=None):
    """(algorithm, p1, p2, p3) as src/limit.rs derives them."""
    alg = alg or rng.randint(1, 5)
    big = rng.random() < 0.1
    w = rng.choice([1, 7, 1000, 999_999, 1_000_000, 60_000_000, rng.randint(1, 5_000_000)])
    if big:
        w = rng.choice([3_600_000_000, 315_360_000_000_000 // 1000, rng.randint(1, 10 ** 12)])
    n = rng.choice([1, 2, 3, 5, 10, 100, rng.randint(1, 70000)])
    if big and alg != 1:
        n = rng.randint(1, 10 ** 6)
    if alg == 1:
        return (1, rng.choice([1, 2, 3, 5, 10]), w, 0)
    if alg in (4,):
        return (4, n, w, 0)
    if alg == 5:
        n = min(n, EXACT // 2 ** 20 - 1)
        return (5, n, w, -(-w // 2 ** 20))
    # buckets: amount, per, period reduced by gcd, amount * period + per < 2^53
    from math import gcd
    per = rng.choice([1, 3, 7, 1000, rng.randint(1, 10 ** 6)])
    g = gcd(per, w)
    per, period = per // g, w // g
    amount = n
    while amount * period + per >= EXACT:
        amount = max(1, amount // 1000)
        if amount == 1 and period + per >= EXACT:
            period = period // 1000 + 1
    return (alg, amount, per, period)


def spec_text(limit, cost, wire):
    """A limit's string with its cost, in the wire of a library."""
    if wire == 1:
        return "%d:%d:%d:%d:0:%d" % (limit + (cost,))
    return "%d:%d:%d:%d:%d" % (limit + (cost,))


def decision(reply, wire, limits, extra):
    """A decision's reply, read in its wire: ((outcome, wait, now), per limit
    (kind, wait, remaining, reset) with kind 0 allows, 1 never, 2 blocked,
    `extra` doubles after, the notes); anything else as it is. Wire 2
    leaves the decision's wait out: the longest of its limits' (-1 for
    outcome 2), as src/algorithm/reply.rs reads it."""
    if isinstance(reply, Exception):
        return ("error", str(reply))
    if not isinstance(reply, bytes):
        return reply
    per, head = (3, 3) if wire == 1 else (4, 2)
    n = head + per * limits + extra
    if len(reply) < 8 * n:
        return reply
    d = struct.unpack("<%dd" % n, reply[:8 * n])
    statuses = []
    for i in range(limits):
        f = d[head + per * i:head + per * (i + 1)]
        if wire == 2:
            statuses.append(tuple(f))
        elif f[1] == -1:
            statuses.append((2.0, f[0], 0.0, f[2]))
        elif f[0] == -1:
            statuses.append((1.0, 0.0, f[1], f[2]))
        else:
            statuses.append((0.0,) + tuple(f))
    top = d[:3]
    if wire == 2:
        wait = -1.0 if d[0] == 2 else max([s[1] for s in statuses if s[0] != 1] + [0.0])
        top = (d[0], wait, d[1])
    return (top, statuses, d[head + per * limits:], reply[8 * n:])


def garbage(rng, alg):
    tag, n = {2: (b"T", 6), 3: (b"G", 5), 4: (b"F", 4), 5: (b"S", 5)}.get(alg, (b"M", 7))
    choices = [0.0, 1.0, 5.0, -3.0, 0.5, float("nan"), float("inf"), 2.0 ** 53, 1e300,
               float(int(time.time() * 1e6)), float(rng.randint(0, 10 ** 15))]
    fields = b"".join(struct.pack("<d", rng.choice(choices)) for _ in range(n))
    if rng.random() < 0.2:
        tag = rng.choice([b"X", b"G", b"T", b"F", b"S", b"M"])
    value = tag + fields
    if rng.random() < 0.1:
        value = value[:-1]
    return value


class Monitor:
    """Write commands the libraries issue, read from MONITOR, per call."""

    def __init__(self, port):
        self.c = Conn(port)
        assert self.c("MONITOR") == "OK"

    def until(self, marker):
        lines = []
        while True:
            line = self.c.line().decode("latin-1")
            if marker in line:
                return lines
            lines.append(line)


TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"')


def expiries(writes):
    """The expiry each write command gives its key, in ms ({key: ms or 'keep'})."""
    out = {}
    for line in writes:
        t = TOKEN.findall(line)
        cmd = t[0].upper()
        if cmd == "SET":
            rest = [x.upper() for x in t[3:]]
            if "PX" in rest:
                out[t[1]] = int(t[3 + rest.index("PX") + 1])
            elif "KEEPTTL" in rest:
                out.setdefault(t[1], "keep")
            else:
                out[t[1]] = None
        elif cmd == "PSETEX":
            out[t[1]] = int(t[2])
        elif cmd == "PEXPIRE":
            out[t[1]] = int(t[2])
        elif cmd in ("DEL", "UNLINK"):
            for k in t[1:]:
                out[k] = "deleted"
    return out


WRITES = re.compile(r'\[\d+ lua\] "(SET|PSETEX|PEXPIRE|PEXPIREAT|EXPIRE|ZADD|ZREM|ZREMRANGEBYSCORE|ZREMRANGEBYRANK|DEL|UNLINK)"', re.I)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commands", action="store_true")
    ap.add_argument("--alg", type=int, default=None, help="only this algorithm (1 to 5)")
    args = ap.parse_args()

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    tmp = tempfile.mkdtemp()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", tmp, "--loglevel", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                c = Conn(port)
                c("PING")
                break
            except OSError:
                time.sleep(0.05)
        names, wires = {}, {}
        for side, rev in (("refx", args.rev), ("work", "work")):
            name, lib, wire = library(rev)
            r = c("FUNCTION", "LOAD", "REPLACE", lib)
            if isinstance(r, Exception):
                raise SystemExit("%s: %s" % (rev, r))
            names[side], wires[side] = name, wire
            print("%s: %s, wire %d" % (rev, name, wire))
        mon = Monitor(port)
        rng = random.Random(args.seed)
        failures = steps = 0
        marker_no = 0

        def call(side, keys, argv):
            nonlocal marker_no
            marker_no += 1
            marker = "marker-%s-%d" % (side, marker_no)
            reply = c("FCALL", names[side], len(keys), *keys, *argv)
            c("ECHO", marker)
            lines = [l for l in mon.until(marker) if WRITES.search(l)]
            writes = [re.sub(r'^\S+ ', "", l).replace('"%s:' % side, '"K:') for l in lines]
            return reply, writes

        def snapshot(keys):
            out = []
            for k in keys:
                t = c("TYPE", k)
                if t == "zset":
                    v = c("ZRANGE", k, 0, -1, "WITHSCORES")
                elif t == "string":
                    v = c("GET", k)
                else:
                    v = t
                out.append((t, v, c("PTTL", k) == -1))
            return out

        for case in range(args.cases):
            limit = rand_limit(rng, args.alg)
            alg = limit[0]
            other = rand_limit(rng) if rng.random() < 0.3 else None
            tag = "{c%d}" % case
            keysets = {}
            for side in ("refx", "work"):
                ks = ["%s:%s:l:%s" % (side, tag, p) for p in KEY_PARTS[alg]]
                if other:
                    ks += ["%s:%s:o:%s" % (side, tag, p) for p in KEY_PARTS[other[0]]]
                keysets[side] = ks
            now = 1_800_000_000_000_000 + rng.randint(0, 10 ** 9)
            # a shared history: other limits of this algorithm, garbage, wrong types
            for _ in range(rng.randint(0, 3)):
                kind = rng.random()
                if kind < 0.6:
                    prior = rand_limit(rng, alg)
                    argv = ["o:%d:%d:0:%d" % (now, rng.choice([0, 10 ** 6]), HOUR),
                            spec_text(prior, rng.randint(1, 3), wires["refx"])]
                    for side in ("refx", "work"):
                        call("refx", keysets[side][:len(KEY_PARTS[alg])], argv)
                    now += rng.randint(0, 2 * limit[2] if alg in (1, 4, 5) else 10 ** 6)
                elif kind < 0.9:
                    i = rng.randrange(len(KEY_PARTS[alg]))
                    value = garbage(rng, alg)
                    for side in ("refx", "work"):
                        c("SET", keysets[side][i], value)
                else:
                    i = rng.randrange(len(KEY_PARTS[alg]))
                    for side in ("refx", "work"):
                        c("DEL", keysets[side][i])
                        c("HSET", keysets[side][i], "f", "v")
            for step in range(rng.randint(1, 25)):
                r = rng.random()
                w = limit[2] if alg in (1, 4, 5) else max(1, limit[3] // max(1, limit[2]))
                if r < 0.05:
                    now -= rng.randint(1, 10 ** 6)  # a clock step back
                elif r < 0.5:
                    now += rng.randint(0, max(1, w // 4))
                else:
                    now += rng.choice([0, 1, rng.randint(0, 3 * w)])
                cost = rng.choice([0, 1, 1, 1, 2, rng.randint(1, limit[1] + 2), limit[1], limit[1] + 1])
                max_wait = rng.choice([0, 0, 0, 1, rng.randint(0, 2 * w)])
                dry = 1 if rng.random() < 0.1 else 0
                # (keys must not expire in real time between the two calls)
                slack = HOUR + rng.choice([0, 0, 1500, 10 ** 6])
                op = rng.random()
                other_cost = rng.choice([0, 1])
                take = False
                if op < 0.08:
                    at = now - rng.choice([0, rng.randint(0, w)])
                    opts = "o:%d:0:0:%d:1:%d" % (now, slack, at)
                elif op < 0.14:
                    opts = "o:%d:0:0:%d:2:0" % (now, slack)
                    take = True
                elif (now, max_wait, dry, slack) == (0, 0, 0, 0):
                    opts = None
                else:
                    opts = "o:%d:%d:%d:%d" % (now, max_wait, dry, slack)
                results = {}
                for side in ("refx", "work"):
                    specs = [spec_text(limit, cost, wires[side])]
                    if other:
                        specs.append(spec_text(other, other_cost, wires[side]))
                    argv = ([opts] if opts else []) + specs
                    reply, writes = call(side, keysets[side], argv)
                    results[side] = (decision(reply, wires[side], len(specs), 1 if take else 0), writes)
                states = {side: snapshot(keysets[side]) for side in ("refx", "work")}
                steps += 1
                problems = []
                if results["refx"][0] != results["work"][0]:
                    problems.append("reply %r != %r" % (results["refx"][0], results["work"][0]))
                if states["refx"] != states["work"]:
                    problems.append("state %r != %r" % (states["refx"], states["work"]))
                ref_exp = [l for l in results["refx"][1]]
                work_exp = [l for l in results["work"][1]]
                if expiries(ref_exp) != expiries(work_exp):
                    problems.append("expiries %r != %r" % (expiries(ref_exp), expiries(work_exp)))
                if args.commands and ref_exp != work_exp:
                    problems.append("commands %r != %r" % (ref_exp, work_exp))
                if problems:
                    failures += 1
                    print("case %d step %d: limit %r other %r argv %r" % (case, step, limit, other, argv))
                    for p in problems:
                        print("   ", p)
                    if failures > 10:
                        raise SystemExit(1)
        # The production path (no options: Redis' own clock) cannot be
        # compared call by call; check what it writes: every log member's
        # score is the time it records, and the reply's clock is Redis'.
        for case in range(args.cases // 4):
            limit = rand_limit(rng, args.alg)
            alg = limit[0]
            ks = ["work:{r%d}:l:%s" % (case, p) for p in KEY_PARTS[alg]]
            for call_no in range(rng.randint(1, 6)):
                if case < 6 and call_no == 0:
                    # just after a second begins: a clock of fewer digits of us
                    t = c("TIME")
                    time.sleep((10 ** 6 - int(t[1])) / 1e6 + rng.choice([0.0015, 0.004, 0.02, 0.06]))
                before = c("TIME")
                reply = c("FCALL", names["work"], len(ks), *ks,
                          spec_text(limit, rng.choice([0, 1, 1, 2]), wires["work"]))
                reply = decision(reply, wires["work"], 1, 0)
                after = c("TIME")
                steps += 1
                problems = []
                if not isinstance(reply, tuple) or reply[2:] != ((), b""):
                    problems.append("reply %r" % (reply,))
                else:
                    now = reply[0][2]
                    lo = int(before[0]) * 10 ** 6 + int(before[1])
                    hi = int(after[0]) * 10 ** 6 + int(after[1])
                    if not lo <= now <= hi:
                        problems.append("clock %r outside [%r, %r]" % (now, lo, hi))
                if alg == 1:
                    z = c("ZRANGE", ks[0], 0, -1, "WITHSCORES")
                    for member, score in zip(z[::2], z[1::2]):
                        if len(member) == 25 and struct.unpack("<d", member[1:9])[0] != float(score):
                            problems.append("member %r has score %r" % (member, score))
                if problems:
                    failures += 1
                    print("real-clock case %d: limit %r" % (case, limit))
                    for p_ in problems:
                        print("   ", p_)
        print("%d cases, %d steps, %d disagreements" % (args.cases, steps, failures))
        sys.exit(1 if failures else 0)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
