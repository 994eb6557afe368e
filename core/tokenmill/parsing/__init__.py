"""Reading formats out of model output text as it grows: JSON written so far and markers split
across tokens. Shared by the tool-call and reasoning parser plugins."""
