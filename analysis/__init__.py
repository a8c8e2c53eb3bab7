"""Measurements of the open problem behind the model (DESIGN.md section 4): rank collapse, intrinsic rank, geometry."""
