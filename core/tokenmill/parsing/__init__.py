"""Reading formats out of model output text: JSON written so far, markers split across tokens, and
the calls of TGI's grammar-held tool format. Shared by the tool-call and reasoning parser plugins."""
