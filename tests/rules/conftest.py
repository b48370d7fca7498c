"""Load every rule family before any test module imports one of them directly.

`registry._load` imports the families only while the registry is empty, so importing, say,
`autoshard.rules.einsum` first would leave the other families unregistered.
"""

from autoshard.rules import supported_op_types

supported_op_types()
