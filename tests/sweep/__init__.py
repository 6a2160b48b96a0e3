"""The bad-input and kill sweep through the real CLI (slow suite), and its script."""
