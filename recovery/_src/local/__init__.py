"""The local tier: each host's own copy of what it holds, peer copies, and restore from the newest complete local step."""
