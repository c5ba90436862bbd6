"""The router: `deja route`, picking a replica per Generate call and relaying its stream."""
