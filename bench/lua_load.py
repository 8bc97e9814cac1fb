#!/usr/bin/env python3
"""bench/lua_load.py: drives one command at a Redis server, as redis-benchmark
would, but with ONE random key number per command, substituted for every
`{k}` in its arguments (redis-benchmark draws a new number for each
`__rand_int__`, which would give a sliding log's two keys different tags).

    lua_load.py PORT REQUESTS CLIENTS KEYSPACE ARG...

CLIENTS connections each keep one command in flight (redis-benchmark's
`-c CLIENTS -P 1`); key numbers are uniform in [0, KEYSPACE). Prints the
requests per second; exits non-zero when any reply is an error. Used by
bench/lua.sh; the Redis time per call comes from INFO commandstats.
"""
import random
import selectors
import socket
import sys
import time


def encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def reply_end(buf, pos):
    """The index just after the RESP reply starting at `pos`, or -1."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        return -1
    kind = buf[pos]
    if kind in (43, 45, 58):  # + - :
        return nl + 2
    n = int(buf[pos + 1:nl])
    if kind == 36:  # $
        if n < 0:
            return nl + 2
        end = nl + 2 + n + 2
        return end if len(buf) >= end else -1
    if kind == 42:  # *
        at = nl + 2
        for _ in range(max(n, 0)):
            at = reply_end(buf, at)
            if at < 0:
                return -1
        return at
    raise ValueError("unexpected reply %r" % buf[pos:pos + 40])


def main():
    port, requests, clients, keyspace = (int(x) for x in sys.argv[1:5])
    template = sys.argv[5:]
    commands = [encode([a.replace("{k}", str(i)) for a in template]) for i in range(keyspace)]
    rand = random.Random(7)
    sel = selectors.DefaultSelector()
    sent = done = errors = 0
    first_error = None
    bufs = {}
    for _ in range(min(clients, requests)):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        bufs[s] = b""
        sel.register(s, selectors.EVENT_READ)
        s.sendall(commands[rand.randrange(keyspace)])
        sent += 1
    start = time.perf_counter()
    while done < requests:
        for key, _ in sel.select():
            s = key.fileobj
            data = s.recv(65536)
            if not data:
                raise SystemExit("connection closed by the server")
            buf = bufs[s] + data
            end = reply_end(buf, 0)
            if end < 0:
                bufs[s] = buf
                continue
            if buf[0] == 45:
                errors += 1
                first_error = first_error or buf[:end]
            bufs[s] = buf[end:]
            done += 1
            if sent < requests:
                s.send(commands[rand.randrange(keyspace)])
                sent += 1
    elapsed = time.perf_counter() - start
    print("%.0f" % (requests / elapsed))
    if errors:
        print("%d errors, e.g. %r" % (errors, first_error), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
