"""Chapter 7, continuous batching: a scheduler that refills finished slots every step, preemption, prefix caching."""
