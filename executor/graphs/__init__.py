"""Graph paths: capture a callable once per bucket, replay it with padded inputs."""
