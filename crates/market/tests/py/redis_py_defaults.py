"""redis-py against a producer store: with its default settings (redis-py 8: RESP3, its
first command `HELLO 3 AUTH default <secret>`), and with RESP2 and RESP3 asked for.
Exits non-zero (an AssertionError's traceback) at the first wrong answer."""
import os
import sys

import redis

port = int(os.environ["STORE_PORT"])
secret = os.environ["STORE_SECRET"]
print("redis-py", redis.__version__, file=sys.stderr)

for kwargs in ({}, {"protocol": 2}, {"protocol": 3}):
    r = redis.Redis(host="127.0.0.1", port=port, password=secret, **kwargs)
    assert r.ping() is True, kwargs
    assert r.set("k", "v") is True
    assert r.get("k") == b"v"
    assert r.get("nope") is None
    assert r.set("t", "1", ex=100) is True
    assert r.ttl("t") == 100
    assert r.mget("k", "nope") == [b"v", None]
    assert r.exists("k", "t", "nope") == 2
    # The default pipeline is a transaction: MULTI, the commands, EXEC.
    p = r.pipeline()
    p.set("a", "1").get("a").expire("a", 50)
    assert p.execute() == [True, b"1", True]
    # A command refused when queued: nothing of the transaction applies.
    p = r.pipeline()
    p.set("b", "1")
    p.execute_command("NOSUCH", "x")
    try:
        p.execute()
        raise AssertionError("a transaction with an unknown command ran")
    except redis.ResponseError:
        pass
    assert r.get("b") is None, "a write queued after a refused command was applied"
    # Pipelines without a transaction, too.
    p = r.pipeline(transaction=False)
    p.set("c", "3").get("c")
    assert p.execute() == [True, b"3"]
    assert r.config_get("maxmemory")["maxmemory"] == str(16 << 20)
    assert r.info("memory")["maxmemory"] == 16 << 20
    assert r.client_setname("me") is True
    assert r.client_getname() in ("me", b"me")
    assert r.delete("k", "a", "c", "t") == 4
    assert r.dbsize() == 0
    assert r.flushdb() is True
    r.close()

# (redis-py retries a failed connection a few times: this takes seconds.)
try:
    redis.Redis(host="127.0.0.1", port=port, password="wrong").ping()
    raise AssertionError("a wrong password was accepted")
except redis.AuthenticationError:
    pass
print("ok", file=sys.stderr)
