"""`python -m hicache_server`: the same as `hicache-server` (`hicache_server.launch`)."""

from __future__ import annotations

import sys

from hicache_server.launch import main

sys.exit(main())
