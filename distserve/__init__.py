"""The `distserve` command-line front end."""
