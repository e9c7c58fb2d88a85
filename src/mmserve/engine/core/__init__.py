"""The engine process's side: engine core, its process loop, scheduler driving, executor."""
