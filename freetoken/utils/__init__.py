"""Small helpers that every layer may use; nothing here imports from the rest of freetoken."""
