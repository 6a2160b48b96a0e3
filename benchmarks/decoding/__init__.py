"""Speed and acceptance of the decoding methods: the papers' measurements on real or tiny models."""
