"""The JAX multi-process protocol (``asyncckpt.jax._distributed``) over an in-process store.

Each "process" is a thread with its own ``InProcessCoordinator`` of one shared
store, running the real ``CommitCoordinator``; the two-process tests with
``jax.distributed`` are in ``test_jax_multiprocess_protocol.py``. These pin
the protocol's rules directly: names by directory, one number per attempted
save, one verdict per failed save, keys deleted once every process moved on,
the primary's check of the other processes' manifest parts, shared restore
verdicts, and messages of a size that does not grow with the files.
"""

from __future__ import annotations

import threading

import pytest

import asyncckpt
from asyncckpt import _coordination as coord
from asyncckpt._engine.files import FileRecord
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.jax import _distributed as dist
from asyncckpt.jax import _parts


def _both(f0, f1):
    """Runs ``f0`` and ``f1`` as processes 0 and 1; returns (results, errors)."""
    results, errors = [None, None], [None, None]

    def call(i, f):
        try:
            results[i] = f()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i, f)) for i, f in enumerate((f0, f1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results, errors


def _pair(directory="ckpts", timeout_s=30.0):
    stores = coord.InProcessCoordinator.group(2)
    return stores, [dist.CommitCoordinator(s, timeout_s=timeout_s, directory=directory)
                    for s in stores]


def test_managers_are_named_by_directory_and_count_per_directory():
    stores = coord.InProcessCoordinator.group(2)
    # Process 0 makes managers for a, b, a; process 1 for b, a, a.
    p0 = [dist.CommitCoordinator(stores[0], timeout_s=1, directory=d) for d in ("a", "b", "a")]
    p1 = [dist.CommitCoordinator(stores[1], timeout_s=1, directory=d) for d in ("b", "./a/", "a")]
    assert p0[0].prefix == p1[1].prefix  # "./a/" normalizes to "a"
    assert p0[1].prefix == p1[0].prefix
    assert p0[2].prefix == p1[2].prefix  # the second manager of "a" on each process
    assert len({p0[0].prefix, p0[1].prefix, p0[2].prefix}) == 3
    assert dist.manager_key("s3://bucket/run/") == "s3://bucket/run"


def _save(c: dist.CommitCoordinator, step: int, records: list[FileRecord]):
    _, key = c.next_save(step)
    if c.primary:
        digests, failures = c.collect(key)
        c.announce(key, failures=failures)
        return digests
    c.report_done(key, _parts.encode(c.process_index, records)[1])
    c.wait_committed(key, step)
    return None


def test_keys_of_a_save_are_deleted_once_every_process_moved_on():
    stores, (p0, p1) = _pair()
    values = stores[0]._store.values
    rec = [FileRecord("default/w/1.0", 4, 1)]
    counts = []
    for step in range(30):
        results, errors = _both(lambda s=step: _save(p0, s, []),
                                lambda s=step: _save(p1, s, rec))
        assert errors == [None, None] and results[0] == {1: _parts.encode(1, rec)[1]}
        counts.append(len(values))
    assert counts[-1] == counts[2] <= 3  # the newest save's keys only, never growing


def test_a_saves_messages_do_not_grow_with_its_files(tmp_path):
    """Process 1 reports 10 or 10,000 files with the same few bytes; process 0 reads its part."""
    sizes = []
    for n in (10, 10_000):
        stores, (p0, p1) = _pair()
        values = stores[0]._store.values
        records = [FileRecord(f"default/p{i}/0.0", 4096, i) for i in range(n)]
        _, key = p1.next_save(1)
        assert p0.next_save(1)[1] == key
        _, digest = _parts.write(str(tmp_path), 1, records, fsync=False)
        p1.report_done(key, digest)
        digests, failures = p0.collect(key)
        assert failures == {} and digests == {1: digest}
        sizes.append(len(values[f"{key}/done/1"]))
        parts, bad = _parts.read_all(digests, _parts.local_reader(str(tmp_path)),
                                     where=str(tmp_path))
        assert bad == {} and parts[1] == records
    assert sizes[1] - sizes[0] <= 3, sizes  # only the count's digits differ


def test_a_failure_is_one_verdict_raised_alike_on_every_process():
    _, (p0, p1) = _pair()
    seq0, key = p0.next_save(4)
    assert p1.next_save(4) == (seq0, key)

    def primary():
        return p0.agree_failure(key, 4, OSError(5, "Input/output error"))

    def other():
        p1.report_done(key, _parts.encode(1, [FileRecord("f", 1, 0)])[1])
        p1.wait_committed(key, 4)

    (agreed, _), (_, raised) = _both(primary, other)
    assert isinstance(agreed, dist.DistributedSaveError)
    assert isinstance(raised, dist.DistributedSaveError)
    assert str(agreed) == str(raised)
    assert raised.failures == {0: "OSError: [Errno 5] Input/output error"}
    assert isinstance(raised, asyncckpt.CoordinationError)


def test_a_save_raised_before_staging_fails_the_others_at_once_and_numbers_stay_aligned():
    _, (p0, p1) = _pair(timeout_s=30)
    s0 = dist.Saves(p0, prepare=lambda: None)
    s1 = dist.Saves(p1, prepare=lambda: None)
    rec = _parts.encode(1, [FileRecord("x", 1, 0)])[1]

    def primary():
        token = s0.token()
        with s0.attempt(7) as (seq, key):  # process 0 stages step 7; process 1 cannot
            _, failures = p0.collect(key)
            error = dist.DistributedSaveError(7, p0.announce(key, failures=failures))
        with s0.attempt(8) as (seq8, key8):
            p0.announce(key8, failures=p0.collect(key8)[1])
        return token, seq, error, seq8

    def other():
        token = s1.token()
        with pytest.raises(TypeError), s1.attempt(7):
            raise TypeError("leaf ['oops'] is a builtins.str")
        with s1.attempt(8) as (seq8, key8):
            p1.report_done(key8, rec)
            p1.wait_committed(key8, 8)
        return token, seq8

    (r0, r1), errors = _both(primary, other)
    assert errors == [None, None]
    assert r0[0] == r1[0]  # one run token
    assert r0[3] == r1[1] == r0[1] + 1  # step 8 has the same number on both
    assert "process 1: did not take part" in str(r0[2]) and "TypeError" in str(r0[2])


def test_primary_names_the_parts_missing_from_its_temporary_directory(tmp_path):
    rec = [FileRecord("default/w/0.0", 4, 0)]
    _, d1 = _parts.write(str(tmp_path), 1, rec, fsync=False)
    _, d3 = _parts.write(str(tmp_path), 3, rec, fsync=False)
    (tmp_path / _parts.part_name(3)).write_text('{"files": []}')  # not the part it wrote
    d2 = _parts.encode(2, rec)[1]  # written elsewhere: a directory not shared
    parts, failures = _parts.read_all({1: d1, 2: d2, 3: d3}, _parts.local_reader(str(tmp_path)),
                                      where=str(tmp_path))
    assert parts == {1: rec}
    assert sorted(failures) == [2, 3]
    assert "asyncckpt.part-2.json is missing" in failures[2] and "shares" in failures[2]
    assert "not the one it wrote" in failures[3]


def test_restore_verdicts_are_shared_and_their_keys_deleted():
    stores, (p0, p1) = _pair()
    values = stores[0]._store.values
    v0, v1 = p0.restore_verdicts(), p1.restore_verdicts()
    assert _both(lambda: v0.combine("reads", "ok"), lambda: v1.combine("reads", "c")) == (
        ["1:c", "1:c"], [None, None])
    bad = CorruptCheckpointError("file 'w/3.1' fails its CRC32 check", checkpoint="ck",
                                 file="ck/w/3.1")
    _, errors = _both(lambda: v0.agree("8/default", None), lambda: v1.agree("8/default", bad))
    assert errors[1] is bad
    assert isinstance(errors[0], CorruptCheckpointError)
    assert errors[0].file == "ck/w/3.1" and "found by process 1" in str(errors[0])
    for _ in range(5):
        _both(lambda: v0.agree("7/default", None), lambda: v1.agree("7/default", None))
    assert len(values) <= 4  # the newest round's keys (and maybe the round before)


def test_no_process_waits_on_a_deleted_key_when_saves_raise_before_staging():
    _, (p0, p1) = _pair(timeout_s=2)
    rec = _parts.encode(1, [FileRecord("x", 1, 0)])[1]
    # Process 1's writer reported save 0 but has not read its commit yet, when
    # its training thread raises before staging save 1.
    _, k0 = p0.next_save(0)
    assert p1.next_save(0)[1] == k0
    p1.report_done(k0, rec)
    assert p0.collect(k0)[1] == {}
    p0.announce(k0)
    _, k1 = p1.next_save(1)
    p1.fail_before_staging(k1, 1, ValueError("step 1 exists"))
    assert p0.next_save(1)[1] == k1
    assert "did not take part" in p0.collect(k1)[1][1]
    p0.announce(k1, failures={1: "x"})
    p1.wait_committed(k0, 0)  # still there: that answer came from a training thread
    # Process 0's training thread raises before staging save 3 while its writer
    # still collects save 2's answers: save 3's verdict outlives that collect.
    _, k2 = p0.next_save(2)
    assert p1.next_save(2)[1] == k2
    _, k3 = p0.next_save(3)
    p0.fail_before_staging(k3, 3, TypeError("bad leaf"))
    p1.report_done(k2, rec)
    assert p0.collect(k2)[1] == {}
    p0.announce(k2)
    p1.wait_committed(k2, 2)
    assert p1.next_save(3)[1] == k3
    with pytest.raises(dist.DistributedSaveError, match="process 0: did not take part"):
        p1.wait_committed(k3, 3)


def test_a_restore_given_up_on_one_process_fails_the_others_at_once_and_its_key_goes():
    stores, (p0, p1) = _pair(timeout_s=30)
    values = stores[0]._store.values
    v0, v1 = p0.restore_verdicts(), p1.restore_verdicts()
    v1.abort(OSError(5, "Input/output error"))
    # Process 0 waits for process 1's reads: it hears of the abort, not a 30 s timeout.
    with pytest.raises(asyncckpt.PeerFailedError, match=r"worker 1 failed.*Input/output"):
        v0.combine("reads", "ok")
    aborts = [k for k, v in values.items() if v.startswith("abort:")]
    assert len(aborts) == 2  # process 1's, and process 0's relay of it for the others
    for _ in range(2):  # two restores later, nobody can be waiting on it any more
        w0, w1 = p0.restore_verdicts(), p1.restore_verdicts()
        _both(lambda w=w0: w.agree("1/default", None), lambda w=w1: w.agree("1/default", None))
    assert not any(v.startswith("abort:") for v in values.values())


def test_process_0_giving_up_fails_a_process_waiting_for_its_verdict():
    _, (p0, p1) = _pair(timeout_s=30)
    v0, v1 = p0.restore_verdicts(), p1.restore_verdicts()
    v0.abort(ValueError("target does not match"))
    with pytest.raises(asyncckpt.PeerFailedError, match=r"worker 0 failed.*target does not"):
        v1.combine("reads", "ok")


def test_a_waiting_process_makes_no_calls_while_it_waits():
    """One blocking read per wait, however long: the traffic does not grow with time."""
    import threading

    stores, (p0, p1) = _pair(timeout_s=30)
    calls = []
    for store in stores:  # the coordinators the verdicts talk to, wrapped
        real_get, real_try = store.get, store.try_get
        store.get = lambda *a, _g=real_get, **k: (calls.append("get"), _g(*a, **k))[1]
        store.try_get = lambda *a, _t=real_try, **k: (calls.append("try"), _t(*a, **k))[1]
    v0, v1 = p0.restore_verdicts(), p1.restore_verdicts()
    late = threading.Timer(1.5, lambda: v1.combine("reads", "ok"))
    late.start()
    assert v0.combine("reads", "ok") == "ok"
    late.join()
    assert calls.count("try") == 0
    assert calls.count("get") == 2  # process 0 reads process 1's value, process 1 the result
