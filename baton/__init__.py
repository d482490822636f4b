"""Baton: disaggregated LLM serving."""
