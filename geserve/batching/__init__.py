"""Schedulers: how requests of one model version reach its instances."""
