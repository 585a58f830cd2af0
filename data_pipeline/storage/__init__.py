"""Where bytes live: URLs, the retry policy, and the readers and writers of each scheme (local
files, ``http(s)://``, ``s3://``)."""
