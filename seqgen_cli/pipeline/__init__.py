"""read -> batch -> generate -> write."""
