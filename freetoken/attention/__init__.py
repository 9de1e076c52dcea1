"""Paged attention: batch metadata and the plain-torch reference backend."""
