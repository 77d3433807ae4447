"""The api process's view of the pipeline: stage processes, per-request routing across stages."""
