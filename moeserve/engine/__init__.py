"""The engine: sequences, page pool, scheduler, runner, CUDA graphs and the offline API."""
