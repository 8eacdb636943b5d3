"""Location parsing: supported URLs, local paths, and clear errors for everything else."""

from __future__ import annotations

import os

import pytest

from asyncckpt.storage import UnsupportedURLError
from asyncckpt.storage.url import is_url, parse_location


@pytest.mark.parametrize("url,scheme,bucket,prefix", [
    ("s3://bucket/run", "s3", "bucket", "run"),
    ("gs://my-bucket/a/b/", "gs", "my-bucket", "a/b"),
    ("gs://my-bucket", "gs", "my-bucket", ""),
    ("S3://bucket//x//y", "s3", "bucket", "x/y"),
])
def test_supported_urls(url, scheme, bucket, prefix):
    loc = parse_location(url)
    assert (loc.scheme, loc.bucket, loc.prefix) == (scheme, bucket, prefix)
    assert loc.is_remote and is_url(url)


@pytest.mark.parametrize("bad", [
    "hdfs://namenode/run", "foo://x/y", "gs:/bucket/run", "s3:/bucket", "gs:", "file:/tmp/x",
    "gs://", "gs:///run", "s3://B/run", "gs://bucket/../x", "http://host/x",
])
def test_unsupported_urls_fail_naming_the_supported_ones(bad):
    with pytest.raises(UnsupportedURLError) as e:
        parse_location(bad)
    assert "gs://" in str(e.value) and "s3://" in str(e.value)


@pytest.mark.parametrize("path", ["run", "./a:b", "/tmp/x", "C:/data"])
def test_local_paths(path):
    loc = parse_location(path)
    assert loc.scheme == "file" and loc.prefix == os.path.abspath(path)
    assert not loc.is_remote


def test_storage_imports_no_framework():
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    code = ("import sys, asyncckpt.storage, asyncckpt.storage.protocol, asyncckpt.storage.s3, "
            "asyncckpt.storage.gcs; "
            "print([m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'jax', 'orbax')])")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
