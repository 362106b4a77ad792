#!/usr/bin/env python3
"""Ray baseline for `granule-bench batch`.

Runs the same two workloads as Granule's batch benchmark on a local Ray instance
(`num_cpus=2` by default) and prints ONE JSON object on stdout:

  (a) for_all:    N integer items (put into the object store in --batches chunks
                  beforehand, as Granule's input is a sealed sharded vector), each
                  given --work-us microseconds of calibrated integer work, one Ray
                  task per chunk; the XOR of the results is checked against the
                  plain loop's. For comparison with earlier runs the old definition
                  is timed too: a wall-clock spin per item over bare index ranges;
                  and the same work in --coarse-batches tasks, a task granularity
                  at which Ray's per-task cost matters less;
  (b) word count: D generated documents of W words, a map task per chunk and a
                  reduce (on the driver, or as a tree of tasks, whichever is faster).

Plain single-threaded Python versions of both are timed too, so the report shows
what Ray gains (or loses) over the interpreter it runs on.

Only the JSON goes to stdout: file descriptor 1 is pointed at stderr before Ray is
imported, so Ray's own output (and that of the processes it spawns, which inherit
fd 1) can never corrupt what the Rust caller parses.
"""

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter

MASK64 = (1 << 64) - 1


def spin(us):
    """Busy-wait until `us` microseconds of wall-clock time have passed since the call.

    The benchmark's earlier definition of an item's work, still timed for comparison.
    It is not the same work as the Rust side's: time a worker spends descheduled (by
    Ray's own raylet, say) counts as work done, which calibrated work does not allow.
    """
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


def work(iters, x):
    """`iters` rounds of integer mixing on item `x`: CPU work whose amount does not
    depend on the clock, like the Rust side's calibrated `spin` (see `calibrate`)."""
    for i in range(iters):
        x = (x * 0x2545F4914F6CDD1D + i) & MASK64
    return x


def calibrate(us):
    """Rounds of `work` per item so that one item, call included, takes `us` µs here.

    Times calls with few and with many rounds (median of 5 timings each) and solves the
    straight line per-call time = fixed + rounds × per-round for the rounds; run before
    Ray starts, on an otherwise idle machine, as the Rust side calibrates its own.
    """
    def per_call_ns(rounds, calls=20000):
        timings = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for x in range(calls):
                work(rounds, x)
            timings.append((time.perf_counter_ns() - t0) / calls)
        return statistics.median(timings)

    lo, hi = 4, 64
    t_lo, t_hi = per_call_ns(lo), per_call_ns(hi)
    per_round = (t_hi - t_lo) / (hi - lo)
    fixed = t_lo - lo * per_round
    if per_round <= 0:
        fail("calibration failed: %.1f ns per call with %d rounds, %.1f with %d" % (t_lo, lo, t_hi, hi))
    return max(1, round((us * 1000.0 - fixed) / per_round))


def work_chunk(chunk, iters):
    """XOR of `work` over a chunk of items: what a for_all task (or the plain loop) does."""
    acc = 0
    for x in chunk:
        acc ^= work(iters, x)
    return acc


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def generate_docs(docs, words_per_doc, vocab, seed):
    """Document d, word j is "w" + str(splitmix64(seed ^ (d*W + j)) % V); must match Rust."""
    out = []
    for d in range(docs):
        base = d * words_per_doc
        out.append(" ".join(
            "w" + str(splitmix64((seed ^ (base + j)) & MASK64) % vocab)
            for j in range(words_per_doc)))
    return out


def count_words(docs):
    counts = Counter()
    for doc in docs:
        # Counter.update on an iterable uses CPython's C counting helper: the fastest
        # pure-Python word count, used identically by Ray's map tasks and the baseline.
        counts.update(doc.split(" "))
    return counts


def merge_into(total, part):
    get = total.get
    for word, n in part.items():
        total[word] = get(word, 0) + n
    return total


def checksum(counts):
    return sum(n * (int(word[1:]) + 1) for word, n in counts.items()) & MASK64


def split_ranges(n, parts):
    """`parts` contiguous [lo, hi) ranges covering 0..n, sizes differing by at most 1."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    ranges, lo = [], 0
    for k in range(parts):
        hi = lo + q + (1 if k < r else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def fail(msg, code=2):
    print("ray_batch.py: " + msg, file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, required=True)
    p.add_argument("--work-us", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--docs", type=int, required=True)
    p.add_argument("--words-per-doc", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--coarse-batches", type=int, default=100,
                   help="also time for_all in this many (larger) tasks")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--wordcount-method", choices=("auto", "driver", "tree"), default="auto",
                   help="auto times both reduce strategies and reports the faster one")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="hard limit in seconds for the whole run (never hang the caller)")
    a = p.parse_args()
    for name in ("items", "work_us", "batches", "coarse_batches", "docs", "words_per_doc", "vocab", "reps", "num_cpus"):
        if getattr(a, name) < (0 if name in ("items", "work_us", "docs", "words_per_doc") else 1):
            p.error("--%s out of range: %d" % (name.replace("_", "-"), getattr(a, name)))
    if not 0 <= a.seed <= MASK64:
        p.error("--seed must be a u64")
    return a


def start_watchdog(seconds, ray_mod):
    """Exit the process if the run exceeds `seconds`, whatever Ray is blocked on."""
    def fire():
        print("ray_batch.py: timed out after %.0f s" % seconds, file=sys.stderr, flush=True)
        # Best effort to stop Ray's processes, bounded so a wedged shutdown cannot hang us.
        t = threading.Thread(target=ray_mod.shutdown, daemon=True)
        t.start()
        t.join(10)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main():
    args = parse_args()

    # Keep a private handle on the real stdout for the JSON, then send fd 1 to stderr.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    # Always a fresh local instance with exactly --num-cpus (never an ambient cluster),
    # and no usage-stats reporting (no network besides package registries here).
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    watchdog = start_watchdog(args.timeout, ray)

    # ---- Inputs (not timed) ------------------------------------------------------
    n = args.items
    item_ranges = split_ranges(n, args.batches)
    docs = generate_docs(args.docs, args.words_per_doc, args.vocab, args.seed)
    total_words = args.docs * args.words_per_doc

    items = list(range(n))
    iters = calibrate(args.work_us)

    # ---- Plain single-threaded Python baselines (timed once) ---------------------
    t0 = time.perf_counter()
    python_xor = work_chunk(items, iters)
    python_loop_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    done = 0
    for _i in range(n):
        spin(args.work_us)
        done += 1
    python_spin_loop_s = time.perf_counter() - t0
    if done != n:
        fail("python loop processed %d items, expected %d" % (done, n))

    t0 = time.perf_counter()
    py_counts = count_words(docs)
    python_wc_s = time.perf_counter() - t0
    py_checksum, py_distinct = checksum(py_counts), len(py_counts)
    if sum(py_counts.values()) != total_words:
        fail("python word count total %d != %d" % (sum(py_counts.values()), total_words))

    # ---- Ray ---------------------------------------------------------------------
    # Loopback node address: the whole instance talks over 127.0.0.1 only.
    ray.init(num_cpus=args.num_cpus, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        @ray.remote
        def work_batch(chunk, rounds):
            return work_chunk(chunk, rounds)

        @ray.remote
        def spin_batch(lo, hi, us):
            count = 0
            for _i in range(lo, hi):
                spin(us)
                count += 1
            return count

        @ray.remote
        def count_chunk(chunk):
            # A plain dict pickles more cheaply than a Counter (no __reduce__ round trip).
            return dict(count_words(chunk))

        @ray.remote
        def merge_pair(a, b):
            return merge_into(a, b)

        def reduce_on_driver(refs):
            # Merge as results arrive so the driver's merging overlaps the map tasks.
            total, pending = {}, list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                merge_into(total, ray.get(ready[0]))
            return total

        def reduce_as_tree(refs):
            # Pairwise merge tasks; pair whichever results finish first so no level
            # waits on its slowest member.
            pending = list(refs)
            while len(pending) > 1:
                ready, pending = ray.wait(pending, num_returns=2)
                pending.append(merge_pair.remote(ready[0], ready[1]))
            return ray.get(pending[0]) if pending else {}

        # Warm-up (not timed): start enough workers to fill every CPU and make each
        # of them import every remote function, so start-up cost stays out of the runs.
        warm = 4 * args.num_cpus
        ray.get([spin_batch.remote(0, 1, 20000) for _ in range(warm)])
        ray.get([work_batch.remote(list(range(2000)), iters) for _ in range(warm)])
        warm_counts = ray.get([count_chunk.remote(["w1 w2", "w2"]) for _ in range(warm)])
        ray.get([merge_pair.remote(c, c) for c in warm_counts])

        # The items in the object store, one object per task, as Granule's are sealed
        # in a sharded vector before its job starts.
        item_refs = [ray.put(items[lo:hi]) for lo, hi in item_ranges if hi > lo]
        coarse_refs = [ray.put(items[lo:hi]) for lo, hi in split_ranges(n, args.coarse_batches)
                       if hi > lo]

        chunk_ranges = split_ranges(args.docs, args.batches)
        # Input already in the object store, as Granule's input is already sharded.
        chunk_refs = [ray.put(docs[lo:hi]) for lo, hi in chunk_ranges] if args.docs else []

        methods = ["driver", "tree"] if args.wordcount_method == "auto" else [args.wordcount_method]
        reducers = {"driver": reduce_on_driver, "tree": reduce_as_tree}
        for_all_times, spin_times, coarse_times = [], [], []
        wc_times = {m: [] for m in methods}

        def for_all(refs):
            t0 = time.perf_counter()
            xor = 0
            for part in ray.get([work_batch.remote(r, iters) for r in refs]):
                xor ^= part
            took = time.perf_counter() - t0
            if xor != python_xor:
                fail("ray for_all's result %#x differs from the plain loop's %#x" % (xor, python_xor))
            return took

        for rep in range(args.reps):
            for_all_times.append(for_all(item_refs))
            coarse_times.append(for_all(coarse_refs))

            t0 = time.perf_counter()
            total = sum(ray.get([spin_batch.remote(lo, hi, args.work_us)
                                 for lo, hi in item_ranges if hi > lo]))
            spin_times.append(time.perf_counter() - t0)
            if total != n:
                fail("ray for_all (spin) processed %d items, expected %d" % (total, n))

            for m in methods:
                t0 = time.perf_counter()
                counts = reducers[m]([count_chunk.remote(r) for r in chunk_refs])
                wc_times[m].append(time.perf_counter() - t0)
                got = sum(counts.values())
                if got != total_words:
                    fail("ray word count (%s) total %d != %d" % (m, got, total_words))
                if (checksum(counts), len(counts)) != (py_checksum, py_distinct):
                    fail("ray word count (%s) differs from the plain Python count" % m)
            print("rep %d: for_all %.3f s (in %d tasks %.3f s, wall-clock spin %.3f s), wordcount %s" % (
                rep + 1, for_all_times[-1], len(coarse_refs), coarse_times[-1], spin_times[-1],
                ", ".join("%s %.3f s" % (m, wc_times[m][-1]) for m in methods)),
                file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    watchdog.cancel()

    for_all_s = statistics.median(for_all_times)
    spin_s = statistics.median(spin_times)
    coarse_s = statistics.median(coarse_times)
    wc_method = min(methods, key=lambda m: statistics.median(wc_times[m]))
    wc_s = statistics.median(wc_times[wc_method])

    def rate(count, seconds):
        return count / seconds if seconds > 0 else None

    result = {
        "ray_version": ray.__version__,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "num_cpus": args.num_cpus,
        "items": n,
        "work_us": args.work_us,
        "batches": args.batches,
        "for_all_seconds": for_all_s,
        "for_all_items_per_s": rate(n, for_all_s),
        "work_iterations": iters,
        "python_loop_seconds": python_loop_s,
        "python_loop_items_per_s": rate(n, python_loop_s),
        "python_loop_us_per_item": python_loop_s * 1e6 / n if n else None,
        "coarse_batches": args.coarse_batches,
        "for_all_coarse_seconds": coarse_s,
        "for_all_coarse_items_per_s": rate(n, coarse_s),
        "for_all_spin_seconds": spin_s,
        "for_all_spin_items_per_s": rate(n, spin_s),
        "python_spin_loop_seconds": python_spin_loop_s,
        "docs": args.docs,
        "words_per_doc": args.words_per_doc,
        "vocab": args.vocab,
        "wordcount_seconds": wc_s,
        "wordcount_words_per_s": rate(total_words, wc_s),
        "wordcount_method": wc_method,
        "wordcount_checksum": py_checksum,
        "wordcount_distinct": py_distinct,
        "python_wordcount_seconds": python_wc_s,
        "reps": args.reps,
    }
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
