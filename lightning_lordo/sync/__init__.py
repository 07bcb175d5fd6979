"""One synchronization round over a process group, independent of Lightning: exchange every collective, then commit."""
