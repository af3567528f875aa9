"""Data in object stores (``s3://bucket/prefix`` and other fsspec URLs): listing and reading with retries
(``store``), errors that name the object (``errors``), a shared local disk cache (``cache``), an image folder laid
out in a bucket (``folder``), URL parsing (``urls``) and a local S3 server for tests and benchmarks (``local_s3``).
"""
