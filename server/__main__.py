"""`python -m server`: the same as `hicache-server` (`server.launch`)."""

from __future__ import annotations

import sys

from server.launch import main

sys.exit(main())
