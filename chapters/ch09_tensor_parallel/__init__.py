"""Chapter 9, tensor parallelism: one model split over N ranks, two all-reduces per layer."""
