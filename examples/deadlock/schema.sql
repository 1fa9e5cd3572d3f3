-- Two accounts that both nightly jobs touch. Run once against the staging database.
DROP TABLE IF EXISTS accounts;
CREATE TABLE accounts (
    id      integer PRIMARY KEY,
    name    text    NOT NULL,
    balance numeric NOT NULL
);
INSERT INTO accounts VALUES (1, 'customers', 10000), (2, 'fees', 0);
