"""What runs inside the training job: preemption handling at step boundaries."""
