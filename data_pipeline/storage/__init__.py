"""Where bytes live: URLs and the readers of each scheme (local files, http(s))."""
