"""S3: a multipart upload left by a killed writer is found and aborted."""

from __future__ import annotations

import uuid

import pytest

from asyncckpt.storage.stores import open_store

botocore_session = pytest.importorskip("botocore.session")


def test_orphaned_multipart_upload_is_aborted(s3_server):
    prefix = f"mp-{uuid.uuid4().hex[:8]}"
    client = botocore_session.get_session().create_client("s3")  # AWS_ENDPOINT_URL etc.
    up = client.create_multipart_upload(Bucket="asyncckpt-test", Key=f"{prefix}/7/big")
    client.upload_part(Bucket="asyncckpt-test", Key=f"{prefix}/7/big", PartNumber=1,
                       UploadId=up["UploadId"], Body=b"x" * (5 << 20))
    store = open_store(f"s3://asyncckpt-test/{prefix}")
    assert store.abort_incomplete_uploads() == 1
    left = client.list_multipart_uploads(Bucket="asyncckpt-test", Prefix=prefix)
    assert left.get("Uploads", []) == []
    assert store.abort_incomplete_uploads() == 0
