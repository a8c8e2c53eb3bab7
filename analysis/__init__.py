"""Measurements of the open problem behind the model (docs/design.md section 4): rank collapse, intrinsic rank, geometry."""
