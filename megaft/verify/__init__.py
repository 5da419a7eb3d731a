"""`megaft-verify`: a user's configuration against the single process, step by step."""
