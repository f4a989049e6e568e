"""visionssm.tracking: single-object tracking (OSTrack-style one-stream tracker) on any visionssm backbone."""
