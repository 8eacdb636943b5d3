"""Measures the object-store client candidates against local S3 and GCS servers.

Starts SeaweedFS (S3) and fake-gcs-server (GCS) on 127.0.0.1, points every
client at them through the standard environment variables only
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``AWS_ALLOW_HTTP``; ``STORAGE_EMULATOR_HOST``), and reports for
each client and server: whether it reached the server from the environment,
put and get throughput of one object, and whether a create-only put of an
existing key is refused. The choice in docs/storage.md rests on these numbers.

Usage: python benchmarks/archive/bench_storage_clients.py [--mib 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from tests.servers import FakeGCS, SeaweedS3

BUCKET = "bench"


def _timeit(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _obstore(kind: str):
    import obstore as obs
    from obstore.store import GCSStore, S3Store

    if kind == "s3":
        store = S3Store(BUCKET)  # endpoint, keys, region, allow_http: from the environment
    else:
        # obstore's GCS store ignores STORAGE_EMULATOR_HOST and skip_signature: it needs a
        # base URL and a token; it speaks the XML API, which fake-gcs-server does not serve.
        store = GCSStore(BUCKET, config={"base_url": os.environ["STORAGE_EMULATOR_HOST"]},
                         client_options={"allow_http": True},
                         credential_provider=lambda: {"token": "emulator", "expires_at": None})

    def put(key, data):
        obs.put(store, key, memoryview(data), chunk_size=16 << 20, max_concurrency=8)

    def get(key):
        return obs.get(store, key).bytes()

    def put_create(key, data):
        obs.put(store, key, data, mode="create")

    return put, get, put_create


def _fsspec(kind: str):
    if kind == "s3":
        import s3fs

        fs = s3fs.S3FileSystem()  # honours AWS_ENDPOINT_URL through botocore
    else:
        from gcsfs.core import GCSFileSystem  # not the "extended" one: it probes gRPC for 60 s

        fs = GCSFileSystem(token="anon")  # honours STORAGE_EMULATOR_HOST

    def put(key, data):
        fs.pipe_file(f"{BUCKET}/{key}", bytes(data))

    def get(key):
        return fs.cat_file(f"{BUCKET}/{key}")

    def put_create(key, data):
        if kind == "s3":
            fs.call_s3("put_object", Bucket=BUCKET, Key=key, Body=data, IfNoneMatch="*")
        else:
            fs.pipe_file(f"{BUCKET}/{key}", data, mode="create")

    return put, get, put_create


def _tensorstore(kind: str):
    import tensorstore as ts

    if kind == "s3":
        spec = {"driver": "s3", "bucket": BUCKET, "endpoint": os.environ["AWS_ENDPOINT_URL"],
                "aws_region": os.environ["AWS_REGION"]}
    else:
        # tensorstore ignores STORAGE_EMULATOR_HOST: it needs its own variables.
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = os.environ["STORAGE_EMULATOR_HOST"]
        os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
        spec = {"driver": "gcs", "bucket": BUCKET}
    kv = ts.KvStore.open(spec).result()

    def put(key, data):
        kv.write(key, bytes(data)).result()

    def get(key):
        return kv.read(key).result().value

    def put_create(key, data):
        # A conditional write on "no generation" is tensorstore's create-only put.
        kv.write(key, data, if_equal=ts.KvStore.TimestampedStorageGeneration().generation
                 ).result()

    return put, get, put_create


CLIENTS = {"obstore": _obstore, "fsspec": _fsspec, "tensorstore": _tensorstore}


def measure(client: str, kind: str, data: np.ndarray, rounds: int) -> dict:
    out: dict = {"client": client, "server": kind}
    try:
        put, get, put_create = CLIENTS[client](kind)
        key = f"{client}/blob"
        nbytes = data.nbytes
        put(key, data)  # warm-up, and proves the environment reached the server
        out["reached"] = True
        t = _timeit(lambda: put(key, data), rounds)
        out["put_MiBps"] = round(nbytes / t / 2**20, 1)
        got = get(key)
        out["get_roundtrip_ok"] = bytes(got) == data.tobytes()
        t = _timeit(lambda: get(key), rounds)
        out["get_MiBps"] = round(nbytes / t / 2**20, 1)
        marker = f"{client}/marker"
        put_create(marker, b"first")
        try:
            put_create(marker, b"second")
            out["create_only_refused"] = False
        except Exception as e:  # the client's already-exists / precondition error
            out["create_only_refused"] = True
            out["create_only_error"] = type(e).__name__
        out["after_create"] = bytes(get(marker)).decode()
    except Exception as e:
        out["reached"] = out.get("reached", False)
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        traceback.print_exc(file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--servers", default="s3,gcs")
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.servers.split(","):
            server = SeaweedS3(os.path.join(tmp, "s3")) if kind == "s3" else FakeGCS(
                os.path.join(tmp, "gcs"))
            with server:
                server.make_bucket(BUCKET)
                os.environ.update(server.env())
                for client in args.clients.split(","):
                    r = measure(client, kind, data, args.rounds)
                    print(json.dumps(r), flush=True)
                    results.append(r)
                for k in server.env():
                    os.environ.pop(k, None)
    print(json.dumps({"mib": args.mib, "results": results}))


if __name__ == "__main__":
    main()
