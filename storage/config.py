"""Storage section of the run config. Owns where a run's state lives."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class S3Options(BaseModel):
    """Options for ``s3://`` roots. Credentials are never fields here: they come
    from the standard AWS environment variables, so they never reach run.json."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(
        None, description="S3 endpoint, e.g. http://127.0.0.1:5000 for a moto server; None: AWS"
    )
    region: str | None = Field(None, description="S3 region; None: botocore's default")
    anon: bool = Field(False, description="Unsigned requests (a public bucket): no credentials")
    # Added: botocore attempts per request (standard retry mode); None keeps botocore's default.
    max_attempts: int | None = Field(
        None,
        ge=1,
        description="botocore's attempts per request (standard retry mode), not repeated by "
        "s3fs (its own 5 tries of timeouts and dropped connections are turned off); None: "
        "botocore's default, inside s3fs's 5 tries",
    )
    # Per request: an endpoint that accepts and never answers ends the request
    # here (botocore's default is 60 s each, times every attempt), so a step
    # stuck on storage fails and Prefect retries it.
    connect_timeout_s: float = Field(10.0, gt=0, description="S3 connect timeout per request")
    read_timeout_s: float = Field(60.0, gt=0, description="S3 read timeout per request")


class StorageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root: str = Field(
        "runs", description="Run root: a plain path, file://, s3://bucket/prefix, ..."
    )
    keep_last: int | None = Field(
        None, ge=1, description="Keep this many versions/checkpoints; None keeps all"
    )
    lease_ttl_s: float = Field(
        60.0, gt=0, description="A lease not renewed for this long may be taken over"
    )
    s3: S3Options = S3Options()
