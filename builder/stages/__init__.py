"""Pipeline stages. Each module is a verb and exports an async function of the same name."""
