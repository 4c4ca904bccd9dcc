"""The controller's Ray adapter, the one place the controller meets Ray: the backend, joining or starting the
cluster, and placement groups as resource pools."""
