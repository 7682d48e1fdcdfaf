"""Argument checks shared by the paged-attention kernel and its references: shapes, dtypes, devices."""
